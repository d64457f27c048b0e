"""stk.train.checkpoint.worldsize: the accumulation that keeps the effective batch on another number of ranks and the
refusal where none does (in-process, and through stk-train before any model loads). The resumed runs:
tests/integration/test_train_worldsize.py; the sampler's position and the EMA's shares: tests/unit/train/."""

from __future__ import annotations

import json
import re

import pytest
from support.commands import FAST, run_train

from stk.errors import InputError
from stk.models import Family
from stk.train.checkpoint.worldsize import accumulation_for
from stk.train.options import TrainOptions

SAVED = {"world_size": 2, "batch_size": 2, "grad_accum": 1, "optimizer": "adamw"}  # an effective batch of 4


@pytest.mark.parametrize(
    ("batch_size", "grad_accum", "world_size", "expected"),
    [(2, 1, 1, 2), (1, 1, 4, 1), (2, 1, 2, 1), (1, 1, 1, 4), (2, 3, 2, 3)],  # the last: as given on 2 ranks
)
def test_the_accumulation_that_keeps_the_effective_batch(batch_size, grad_accum, world_size, expected):
    assert accumulation_for(SAVED, batch_size, grad_accum, world_size, "ckpt", override=False) == expected


def test_no_accumulation_keeps_it_refused_naming_the_sizes_that_do_unless_overridden():
    message = (
        "ckpt was trained with an effective batch of 4 (2 ranks x --batch-size 2 x --grad-accum 1), which 3 ranks "
        "x --batch-size 2 cannot make: resume on 1 or 2 ranks at --batch-size 2, or add --override-resume to "
        "continue with an effective batch of 6"
    )
    with pytest.raises(InputError, match=re.escape(message)):
        accumulation_for(SAVED, 2, 1, 3, "ckpt", override=False)
    assert accumulation_for(SAVED, 2, 1, 3, "ckpt", override=True) == 1
    with pytest.raises(InputError, match=re.escape("resume with --batch-size 2, or add --override-resume")):
        accumulation_for(SAVED, 3, 1, 1, "ckpt", override=False)
    with pytest.raises(InputError, match=r"trained with Lion on 2 ranks: .* resume on 2 ranks"):
        accumulation_for({**SAVED, "optimizer": "lion"}, 2, 1, 1, "ckpt", override=False)
    assert accumulation_for({"batch_size": 2, "grad_accum": 1}, 2, 5, 3, "ckpt", override=False) == 5  # no record


def test_stk_train_refuses_before_any_model_loads(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000002")
    settings = TrainOptions(model=model, output_dir=str(out), batch_size=2).run_settings(Family.SD, 2)
    (checkpoint / "stk-run.json").write_text(json.dumps(settings))
    refused = run_train(["--cache", cache, "--model", model, "--output-dir", out, *FAST, "--batch-size", "3"], mpi=0)
    assert refused.returncode == InputError.exit_code, refused.stderr
    assert refused.stderr.count("cannot make: resume with --batch-size 2, or add --override-resume") == 1
    assert "DeepSpeed" not in refused.stderr and not (out / "metrics.jsonl").exists()
