"""stk.train.deepspeed.config: the DeepSpeed config a run gets, from the presets or the user's file."""

from __future__ import annotations

import json

import pytest
from support.commands import REPO

from stk.errors import InputError
from stk.train.deepspeed.config import PRESETS, builds_own_optimizer, load_deepspeed_config, training_config, zero_stage
from stk.train.deepspeed.optim import OptimizerSettings, optimizer_section


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_get_stks_settings(preset):
    base = load_deepspeed_config(preset)
    assert zero_stage(base) == int(preset[4])
    config = training_config(base, 4, 2, 1.0, "bf16", None)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 1.0 and config["bf16"]["enabled"] is True
    assert "train_batch_size" not in config and "scheduler" not in config
    assert builds_own_optimizer(base) == preset.endswith("offload")
    assert base == load_deepspeed_config(preset), "the preset must not be changed in place"


def test_the_etc_presets_are_the_packaged_ones():
    etc = REPO / "etc" / "deepspeed"
    for preset in PRESETS:
        assert json.loads((etc / f"{preset}.json").read_text()) == load_deepspeed_config(preset)


def test_user_config_settings_owned_by_stk_are_overridden(tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "train_batch_size": 999,
                "train_micro_batch_size_per_gpu": 16,
                "scheduler": {"type": "WarmupLR"},
            }
        )
    )
    config = training_config(
        load_deepspeed_config(str(path)), 2, 1, 0.5, "fp32", optimizer_section(OptimizerSettings())
    )
    assert config["train_micro_batch_size_per_gpu"] == 2 and "train_batch_size" not in config
    assert config["bf16"]["enabled"] is False and config["optimizer"]["type"] == "AdamW"
    assert "scheduler" not in config
    assert "train_micro_batch_size_per_gpu=16" in caplog.text


def test_a_user_config_that_names_an_optimizer_lets_deepspeed_build_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    assert builds_own_optimizer(load_deepspeed_config(str(path)))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "is a JSON object, not list"),
        ('{"fp16": {"enabled": true}}', "fp16 is not supported"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_deepspeed_files(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_deepspeed_config(str(path))
