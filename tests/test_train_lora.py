"""stk-train --lora-rank: settings and targets checked before any model loads, the adapter on every family's
denoiser, and a LoRA run resumed bitwise under ZeRO-3 on 2 MPI ranks. Elsewhere: each family trained under
another preset and loaded with `pipe.load_lora_weights` (the ZeRO matrix, test_train.py), and the resumes refused
because they would load other adapter weights (test_train_lease.py)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file
from support.helpers import FAST, SAMPLING, metrics, run_train, sample_pngs, samples_match, summary_of

from stk.errors import InputError
from stk.models import Family
from stk.models.families import spec_for
from stk.train.lora import LORA_WEIGHTS, LoraSettings, add_lora, check_targets
from stk.train.objectives import objective_for

DENOISER = {Family.SD: "unet", Family.SDXL: "unet", Family.FLUX: "transformer"}
RANK = 4


# --- options that cannot work, refused before any model loads ----------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (LoraSettings(rank=-1), "--lora-rank -1"),
        (LoraSettings(rank=4, alpha=0), "--lora-alpha 0"),
        (LoraSettings(rank=4, dropout=1.0), "--lora-dropout 1.0"),
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
    assert spec_for(family).lora_targets


def test_flux_default_targets_are_diffusers_and_leave_the_final_projection_alone(tmp_path):
    from peft.tuners.lora import LoraLayer

    from stk.models import build_tiny_model

    # transcribed from diffusers' examples/dreambooth/train_dreambooth_lora_flux.py (target_modules, no --lora_layers)
    diffusers_flux = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                      "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                      "ff_context.net.2"]  # fmt: skip
    assert sorted(spec_for(Family.FLUX).lora_targets) == sorted(diffusers_flux)
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


# --- resume -----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_ten_lora_steps_equal_five_then_resume_five(setups, tmp_path):
    model, cache = setups(Family.SDXL)
    common = ["--cache", cache, "--model", model, "--deepspeed", "zero3", "--epochs", "2", "--lora-rank", RANK,
              "--ema-decay", "0.8", *FAST, *SAMPLING, "--validation-every", "5"]  # fmt: skip
    straight, split = tmp_path / "straight", tmp_path / "split"
    every_step = ["--checkpoint-every", "1", "--keep-checkpoints", "10"]  # each step's adapter, for the EMA below
    assert run_train([*common, "--output-dir", straight, "--max-steps", "10", *every_step]).returncode == 0
    assert run_train([*common, "--output-dir", split, "--max-steps", "5"]).returncode == 0
    second = run_train([*common, "--output-dir", split, "--max-steps", "10"])
    assert second.returncode == 0, second.stderr
    assert summary_of(second)["resumed_from"].endswith("step-00000005")
    assert [r.get("loss") for r in metrics(straight)][1:] == [r.get("loss") for r in metrics(split)][1:]
    for final in ("final-no-ema", "final"):  # the adapter, and its EMA sharded as ZeRO-3 partitions it
        a, b = load_file(straight / final / LORA_WEIGHTS), load_file(split / final / LORA_WEIGHTS)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), final
    # the EMA of the adapter against one computed here from each step's lora/ file
    steps = [load_file(straight / "checkpoints" / f"step-{s:08d}" / "lora" / LORA_WEIGHTS) for s in range(1, 11)]
    raw = load_file(straight / "final-no-ema" / LORA_WEIGHTS)
    assert all(torch.equal(raw[k], steps[-1][k]) for k in raw)
    expected = dict(steps[0])
    for t, weights in enumerate(steps[1:], start=1):
        decay = min(0.8, (1 + t) / (10 + t))
        expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in expected}
    ema = load_file(straight / "final" / LORA_WEIGHTS)
    assert all(torch.allclose(ema[k], expected[k], rtol=1e-5, atol=1e-7) for k in ema)
    assert any(not torch.allclose(ema[k], raw[k]) for k in ema)
    assert (split / "checkpoints" / "latest").read_text().strip() == "step-00000010"
    # samples made by both ranks together under ZeRO-3 with the adapter's EMA: the same bytes from both runs, and
    # what SDXL's pipeline makes with the EMA adapter loaded, not with the raw one
    for step in (0, 5, 10):
        assert sample_pngs(straight, step) == sample_pngs(split, step), step
    for weights, close in (("final", True), ("final-no-ema", False)):
        pipe = DiffusionPipeline.from_pretrained(model)
        pipe.load_lora_weights(straight / weights)
        assert samples_match(pipe, sample_pngs(straight, 10), guidance=5.0) == close, weights
