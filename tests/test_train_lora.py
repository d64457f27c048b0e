"""stk-train --lora-rank: a peft LoRA on the frozen denoiser, trained by real DeepSpeed engines under
`mpiexec -n 2` on tiny random-weight models, saved in the format `pipe.load_lora_weights` reads, checkpointed,
resumed and refused where a resume would load other weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from helpers import FAST, Recorder, metrics, run_train, step_inputs, summary_of
from safetensors import safe_open
from safetensors.torch import load_file

from stk.errors import ExitCode, InputError
from stk.models import Family
from stk.train.lora import DEFAULT_TARGETS, LORA_WEIGHTS, LoraSettings, add_lora, check_targets
from stk.train.objectives import objective_for

DENOISER = {Family.SD: "unet", Family.SDXL: "unet", Family.FLUX: "transformer"}
RANK = 4


def prediction(denoiser: torch.nn.Module, family: Family, model: str) -> torch.Tensor:
    """The denoiser's output on one fixed training sample (the same noise and timestep every call)."""
    recorder = Recorder(denoiser)
    with torch.no_grad():
        objective_for(family, model).loss(recorder, step_inputs(family), torch.Generator().manual_seed(0))
    return recorder.calls[-1][2]


def trained_module(model: str, family: Family, alpha: float, checkpoints: Path, tag: str) -> torch.nn.Module:
    """The denoiser as training left it, rebuilt without stk's export: the base weights, the same adapter, and the
    adapter's fp32 weights from the DeepSpeed checkpoint (DeepSpeed's own zero_to_fp32 reader)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    objective = objective_for(family, model)
    denoiser = objective.load_denoiser(torch.float32)
    add_lora(denoiser, LoraSettings(rank=RANK, alpha=alpha), family, seed=0)
    saved = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), "the checkpoint holds frozen weights"
    missing, unexpected = denoiser.load_state_dict(saved, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    return denoiser.eval()


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
    assert DEFAULT_TARGETS[family]


def test_a_target_that_matches_nothing_names_the_layers_there_are(tmp_path):
    from stk.models import build_tiny_model

    model = build_tiny_model(Family.SD, str(tmp_path / "model"))
    settings = LoraSettings(rank=RANK, targets=("to_q", "attn9.to_q", "nope"))
    with pytest.raises(InputError, match=r"--lora-targets attn9.to_q,nope: no such layer .* to_out\.0, to_q, to_v"):
        check_targets(settings, objective_for(Family.SD, model))


# --- every family, trained and loaded by diffusers ---------------------------------------------------------------

# Each family under another ZeRO preset; the offload preset builds DeepSpeed's own CPU Adam.
FAMILIES = [
    (Family.SD, "zero2-offload", ["--lora-alpha", "8"]),
    (Family.SDXL, "zero1", ["--lora-dropout", "0.1"]),
    (Family.FLUX, "zero3", []),
]


@pytest.mark.integration
@pytest.mark.parametrize(("family", "preset", "extra"), FAMILIES, ids=[f"{f.value}-{p}" for f, p, _ in FAMILIES])
def test_lora_trains_under_each_preset_and_loads_into_the_pipeline(family, preset, extra, setups, tmp_path):
    model, cache = setups(family)
    out = tmp_path / "run"
    proc = run_train(
        ["--cache", cache, "--model", model, "--output-dir", out, "--deepspeed", preset, "--max-steps", "2",
         "--lora-rank", RANK, *FAST, *extra],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["final"] == str(out / "final")
    assert sorted(p.name for p in (out / "final").iterdir()) == [LORA_WEIGHTS]  # the adapter, not a 12B model
    checkpoint = out / "checkpoints" / "step-00000002"
    assert load_file(checkpoint / "lora" / LORA_WEIGHTS).keys() == load_file(out / "final" / LORA_WEIGHTS).keys()
    with safe_open(out / "final" / LORA_WEIGHTS, "pt") as f:  # alpha travels with the weights
        alpha = json.loads(f.metadata()["lora_adapter_metadata"])[f"{DENOISER[family]}.lora_alpha"]
    assert alpha == (8 if "--lora-alpha" in extra else RANK)

    pipe = DiffusionPipeline.from_pretrained(model)
    base = prediction(getattr(pipe, DENOISER[family]), family, model)
    pipe.load_lora_weights(out / "final")
    loaded = prediction(getattr(pipe, DENOISER[family]), family, model)
    again = prediction(getattr(pipe, DENOISER[family]), family, model)
    assert torch.equal(loaded, again), "the loaded LoRA is not deterministic (dropout left on?)"
    trained = prediction(trained_module(model, family, alpha, out / "checkpoints", "step-00000002"), family, model)
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loaded, base, rtol=1e-4, atol=1e-6), "the LoRA changed nothing"


# --- resume -----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_ten_lora_steps_equal_five_then_resume_five_and_other_weights_are_refused(setups, tmp_path):
    model, cache = setups(Family.SDXL)
    common = ["--cache", cache, "--model", model, "--deepspeed", "zero3", "--epochs", "2", "--lora-rank", RANK, *FAST]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_train([*common, "--output-dir", straight, "--max-steps", "10"]).returncode == 0
    assert run_train([*common, "--output-dir", split, "--max-steps", "5"]).returncode == 0
    second = run_train([*common, "--output-dir", split, "--max-steps", "10"])
    assert second.returncode == 0, second.stderr
    assert summary_of(second)["resumed_from"].endswith("step-00000005")
    assert [r["loss"] for r in metrics(straight)] == [r["loss"] for r in metrics(split)]
    a, b = load_file(straight / "final" / LORA_WEIGHTS), load_file(split / "final" / LORA_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    before = (split / "metrics.jsonl").read_bytes()
    for change, differs in [
        (["--lora-rank", "8"], f"lora-rank {RANK} -> 8"),
        (["--lora-rank", "0"], f"lora-rank {RANK} -> 0"),
    ]:
        args = [*common, "--output-dir", split, "--max-steps", "12", "--override-resume", *change]
        proc = run_train(args, mpi=0, timeout=120)
        assert proc.returncode == ExitCode.INPUT, proc.stderr
        assert f"cannot resume {split}/checkpoints/step-00000010: it holds other weights" in proc.stderr
        assert differs in proc.stderr and proc.stderr.count("it holds other weights") == 1, proc.stderr
    assert (split / "metrics.jsonl").read_bytes() == before
    assert (split / "checkpoints" / "latest").read_text().strip() == "step-00000010"
