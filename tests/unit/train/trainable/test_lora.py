"""stk.train.trainable.lora: settings and targets checked before any model loads, and the adapter on every family's
denoiser. A LoRA run resumed: tests/integration/test_train_lora.py."""

from __future__ import annotations

import pytest
import torch

from stk.errors import InputError
from stk.models import Family
from stk.models.families import spec_for
from stk.train.objective.objectives import objective_for
from stk.train.trainable.lora import LoraSettings, add_lora, check_targets

RANK = 4


# --- options that cannot work, refused before any model loads ----------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (LoraSettings(rank=-1), "--lora-rank -1"),
        (LoraSettings(rank=4, alpha=0), "--lora-alpha 0"),
        (LoraSettings(rank=4, dropout=1.0), "--lora-dropout 1.0"),
        (LoraSettings(rank=4, adapter="oft"), "--adapter oft: give one of lora, loha, lokr"),
        (LoraSettings(rank=4, adapter="lokr", dora=True), "--dora with --adapter lokr: DoRA is a kind of LoRA"),
        (LoraSettings(adapter="loha"), "--adapter loha: give --lora-rank"),
        (LoraSettings(dora=True), "--adapter lora --dora: give --lora-rank"),
    ],
)
def test_impossible_settings_are_refused(settings, message):
    with pytest.raises(InputError, match=message):
        settings.check()


@pytest.mark.parametrize("family", list(Family))
def test_each_familys_default_targets_name_layers_of_its_denoiser(family, tmp_path):
    from stk.models import build_tiny_model

    model = build_tiny_model(family, str(tmp_path / "model"))
    check_targets(LoraSettings(rank=RANK), objective_for(family, model))  # raises if one matched nothing
    denoiser = objective_for(family, model).load_denoiser(torch.float32)
    layers = add_lora(denoiser, LoraSettings(rank=RANK), family, seed=0)
    trainable = [name for name, p in denoiser.named_parameters() if p.requires_grad]
    assert layers > 0 and len(trainable) == 2 * layers and all("lora_" in name for name in trainable)
    assert spec_for(family).denoiser.lora_targets


def test_flux_default_targets_are_diffusers_and_leave_the_final_projection_alone(tmp_path):
    from peft.tuners.lora import LoraLayer

    from stk.models import build_tiny_model

    # transcribed from diffusers' examples/dreambooth/train_dreambooth_lora_flux.py (target_modules, no --lora_layers)
    diffusers_flux = [
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ]
    assert sorted(spec_for(Family.FLUX).denoiser.lora_targets) == sorted(diffusers_flux)
    model = build_tiny_model(Family.FLUX, str(tmp_path / "model"))
    denoiser = objective_for(Family.FLUX, model).load_denoiser(torch.float32)
    add_lora(denoiser, LoraSettings(rank=RANK), Family.FLUX, seed=0)
    assert not isinstance(denoiser.proj_out, LoraLayer)
    assert isinstance(denoiser.single_transformer_blocks[0].attn.to_q, LoraLayer)
    asked = objective_for(Family.FLUX, model).load_denoiser(torch.float32)
    add_lora(asked, LoraSettings(rank=RANK, targets=("proj_out",)), Family.FLUX, seed=0)
    assert isinstance(asked.proj_out, LoraLayer)


def test_a_target_that_matches_nothing_names_the_layers_there_are(tmp_path):
    from stk.models import build_tiny_model

    model = build_tiny_model(Family.SD, str(tmp_path / "model"))
    settings = LoraSettings(rank=RANK, targets=("to_q", "attn9.to_q", "nope"))
    with pytest.raises(InputError, match=r"--lora-targets attn9.to_q,nope: no such layer .* to_out\.0, to_q, to_v"):
        check_targets(settings, objective_for(Family.SD, model))
