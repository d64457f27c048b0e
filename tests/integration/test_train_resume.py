"""stk-train's determinism and resume: the loss falls on a fixed dataset, and ten steps equal five then five resumed.
SIGUSR2 on one rank (a checkpoint, exit for requeue, the rerun resumes): test_slurm_pipeline.py's USR2 job across four
nodes, and under mpiexec test_train_lease.py's first run.

Real DeepSpeed engines on the CPU under `mpiexec -n 2`, tiny random-weight pipelines and caches made by stk-cache
(fixtures `scan` and `setups`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from support.commands import FAST, run_train, summary_of
from support.train_checks import denoiser_weights
from support.train_outputs import SAMPLING, metrics, sample_pngs, samples_match

from stk.models import Family

pytestmark = pytest.mark.integration


def checkpoint_module(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The module's weights in a ZeRO-1/2 checkpoint (every rank holds them all; rank 0 saved them)."""
    states = out / "checkpoints" / f"step-{step:08d}" / "mp_rank_00_model_states.pt"
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


def test_loss_falls_on_a_fixed_dataset(setups, scan, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    proc = run_train(
        [
            "--cache",
            cache,
            "--model",
            model,
            "--output-dir",
            out,
            "--deepspeed",
            "zero2",
            "--max-steps",
            "50",
            "--epochs",
            "10",
            "--checkpoint-every",
            "0",
            *FAST,
        ],
    )
    assert proc.returncode == 0, proc.stderr
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == 50
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, losses


def test_ten_steps_equal_five_then_resume_five(setups, scan, tmp_path):
    """Also: gradient checkpointing (on by default) changes no bit. The straight run keeps its
    activations, the split runs recompute them."""
    model, cache = setups(Family.SDXL)
    common = [
        "--cache",
        cache,
        "--model",
        model,
        "--deepspeed",
        "zero2",
        "--epochs",
        "2",
        "--ema-decay",
        "0.8",
        *FAST,
        *SAMPLING,
        "--validation-every",
        "5",
    ]
    loud = [a for a in common if a != "-q"]  # rank 0's set-up line says whether checkpointing is on
    straight, split = tmp_path / "straight", tmp_path / "split"
    every_step = ["--checkpoint-every", "1", "--keep-checkpoints", "10"]  # each step's weights, for the EMA below
    plain = run_train(
        [*loud, "--output-dir", straight, "--max-steps", "10", "--no-gradient-checkpointing", *every_step]
    )
    assert plain.returncode == 0 and "gradient checkpointing off" in plain.stderr, plain.stderr
    first = run_train([*loud, "--output-dir", split, "--max-steps", "5"])
    assert first.returncode == 0 and summary_of(first)["steps"] == 5
    assert "gradient checkpointing on" in first.stderr, first.stderr
    second = run_train([*common, "--output-dir", split, "--max-steps", "10"])
    assert second.returncode == 0, second.stderr
    assert summary_of(second)["resumed_from"].endswith("step-00000005")
    # same samples, noise and timesteps at every step: the same losses, and bitwise the same weights
    assert [r.get("loss") for r in metrics(straight)][1:] == [r.get("loss") for r in metrics(split)][1:]
    for final in ("final-no-ema", "final"):  # the trained weights, and their EMA sharded over the 2 ranks
        a, b = denoiser_weights(straight / final, Family.SDXL), denoiser_weights(split / final, Family.SDXL)
        assert all(torch.equal(a[k], b[k]) for k in a), final
    # the EMA against one computed here from each step's weights: decay 0 at the first update, then the ramp
    steps = [checkpoint_module(straight, step) for step in range(1, 11)]
    raw = denoiser_weights(straight / "final-no-ema", Family.SDXL)
    assert all(torch.equal(raw[k], steps[-1][k]) for k in raw)
    expected = dict(steps[0])
    for t, weights in enumerate(steps[1:], start=1):
        decay = min(0.8, (1 + t) / (10 + t))
        expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in expected}
    ema = denoiser_weights(straight / "final", Family.SDXL)
    assert all(torch.allclose(ema[k], expected[k], rtol=1e-5, atol=1e-7) for k in ema)
    assert any(not torch.allclose(ema[k], raw[k]) for k in ema)
    # samples: the same PNG bytes from both runs, and those of the final step are what SDXL's own pipeline makes from
    # final/ (the EMA; it encodes the prompts itself), with the same seed, to one level in a few pixels; the raw
    # weights make other images
    for step in (5, 10):
        assert sample_pngs(straight, step) == sample_pngs(split, step), step
    for weights, close in (("final", True), ("final-no-ema", False)):
        pipe = DiffusionPipeline.from_pretrained(straight / weights)
        assert samples_match(pipe, sample_pngs(straight, 10), guidance=5.0) == close, weights
