"""stk-train --lora-rank: a LoRA run resumed bitwise under ZeRO-3 on 2 MPI ranks; a LoRA on an int8 base
(--base-precision) against bf16's loss curve, on one rank in this process. Elsewhere: each family trained
under another preset and loaded with `pipe.load_lora_weights` (the ZeRO matrix, test_train.py), and the resumes
refused because they would load other adapter weights (tests/unit/train/checkpoint/test_store.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from diffusers import DiffusionPipeline
from safetensors.torch import load_file
from support.commands import FAST, clean_env, one_error, run_train, stk_export, summary_of
from support.train_outputs import SAMPLING, metrics, sample_pngs, samples_match

from stk.cli.train import main as train_main
from stk.errors import ExitCode
from stk.models import Family
from stk.train.trainable.lora import LORA_WEIGHTS

# --- resume -----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_ten_lora_steps_equal_five_then_resume_five(setups, tmp_path):
    model, cache = setups(Family.SDXL)
    common = [
        "--cache",
        cache,
        "--model",
        model,
        "--deepspeed",
        "zero3",
        "--epochs",
        "2",
        "--lora-rank",
        4,
        "--ema-decay",
        "0.8",
        *FAST,
        *SAMPLING,
        "--validation-every",
        "5",
    ]
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
    # stk-export of the run's final/ and of a checkpoint, the family read from their records: kohya/ComfyUI keys that
    # diffusers' own converter loads to the same weights (the same prediction per family: tests/unit/export)
    last = straight / "checkpoints" / "step-00000010"
    for source, same_as in ((straight / "final", straight / "final"), (last, straight / "final-no-ema")):
        out = tmp_path / f"{source.name}.safetensors"
        assert stk_export(source, out, "--format", "kohya").returncode == 0
        own, kohya = fused_unet(model, same_as, LORA_WEIGHTS), fused_unet(model, tmp_path, out.name)
        assert own.keys() == kohya.keys() and all(torch.allclose(kohya[k], own[k], atol=1e-6) for k in own), source
    # the checkpoint's adapter changed in place (its size kept): its sha256 in stk-run.json tells, as a resume's would
    adapter = last / "lora" / LORA_WEIGHTS
    with open(adapter, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        flipped = bytes(b ^ 0xFF for b in f.read())
        f.seek(-64, os.SEEK_END)
        f.write(flipped)
    proc = stk_export(last, tmp_path / "damaged.safetensors", "--format", "kohya")
    one_error(proc, ExitCode.INCOMPLETE, f"{last}: the checkpoint is damaged ({adapter}: sha256 ")
    assert not (tmp_path / "damaged.safetensors").exists()


def fused_unet(model: str, folder: Path, weight_name: str) -> dict[str, torch.Tensor]:
    """The UNet's weights with the LoRA in `folder` loaded by diffusers and fused into them."""
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.load_lora_weights(str(folder), weight_name=weight_name)
    pipe.fuse_lora()
    return {k: v for k, v in pipe.unet.state_dict().items() if "base_layer" in k}


# --- a quantised base -----------------------------------------------------------------------------------------------

INT8_LOSS_RTOL = 0.005  # each step's loss on the int8 base against the unquantised one; measured: 3.2e-4 at most


@pytest.mark.integration
@pytest.mark.usefixtures("keep_logging")
def test_a_lora_on_an_int8_base_follows_the_unquantised_loss_curve_and_resume_keeps_it(setups, tmp_path):
    """The tiny FLUX.1 (every layer linear) on one rank: 6 LoRA steps on its int8 base follow the unquantised base's
    loss curve within INT8_LOSS_RTOL, on the same samples, noise and initial adapter; a resume that changes the base
    precision is refused in one line before any model loads (in this process, through click's runner: DeepSpeed
    keeps its process groups for the process, so each training is a process of its own). The int8-trained file
    loading into the pipeline: tests/unit/train/trainable/test_baseprecision.py."""
    model, cache = setups(Family.FLUX)
    args = ["--cache", cache, "--model", model, "--lora-rank", 4, "--no-validation", *FAST]
    for precision in ("bf16", "int8"):
        proc = run_train(
            [*args, "--output-dir", tmp_path / precision, "--max-steps", 6, "--base-precision", precision], mpi=0
        )
        assert proc.returncode == 0, proc.stderr
    curves = {out: [r["loss"] for r in metrics(tmp_path / out) if "loss" in r] for out in ("bf16", "int8")}
    assert len(curves["int8"]) == 6
    assert curves["int8"] != curves["bf16"]  # the base was quantised
    assert curves["int8"] == pytest.approx(curves["bf16"], rel=INT8_LOSS_RTOL)
    argv = [*map(str, args), "--output-dir", str(tmp_path / "int8"), "--max-steps", "8", "--base-precision", "bf16"]
    result = CliRunner().invoke(train_main, argv, env=clean_env(DS_ACCELERATOR="cpu"), catch_exceptions=False)
    assert result.exit_code == ExitCode.INPUT, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert "base-precision int8 -> bf16" in line and "--override-resume" in line, line
    assert (tmp_path / "int8" / "checkpoints" / "latest").read_text().strip() == "step-00000006"
