"""A run that diverges, for real: 2 ranks of the tiny SD model on the CPU under mpiexec, a learning rate of 1e30 held
at 0 for the first step by the warmup, so steps 1 and 2 are finite (and checkpointed) and from step 3 on the loss is
nan on every rank and DeepSpeed skips each update. The checks of the pieces in this process:
tests/unit/train/report/test_divergence.py."""

from __future__ import annotations

import math

import pytest
from support.commands import FAST, one_error, run_train, summary_of
from support.train_checks import latest
from support.train_outputs import board_scalars, metrics

from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration


def test_a_run_that_diverges_stops_every_rank_keeping_the_checkpoints_from_before(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    args = [
        "--cache",
        cache,
        "--model",
        model,
        "--output-dir",
        out,
        "--max-steps",
        "12",
        "--no-validation",
        *FAST,
        "--lr",
        "1e30",
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--max-nonfinite-steps",
        "2",
    ]
    proc = run_train([a for a in map(str, args) if a != "-q"])  # warnings shown: one per non-finite step
    step2 = f"{out}/checkpoints/step-00000002"
    one_error(
        proc,
        ExitCode.DIVERGED,
        "training diverged at step 5: 3 steps in a row were not finite, more than --max-nonfinite-steps 2",
        "(the first: step 3: the loss on rank 0 (2 of 2 ranks) and the gradient norm not finite (nan or inf))",
        f"the newest checkpoint, {step2}, is from before it",
        f"--resume-from {step2} --override-resume",
    )
    warned = [line for line in proc.stderr.splitlines() if "not checkpointed" in line]
    assert [line.split(" WARNING ")[1][:7] for line in warned] == ["step 3:", "step 4:", "step 5:"], proc.stderr
    assert sum("training diverged" in line for line in proc.stderr.splitlines()) == 1  # said once, by rank 0

    # nothing saved from the non-finite steps: the two finite checkpoints outlive --keep-checkpoints 2
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000001", "step-00000002"]
    assert latest(out) == "step-00000002" and not (out / "final").exists()
    summary = summary_of(proc)
    assert (summary["outcome"], summary["steps"], summary["final"], summary["loss"]) == ("diverged", 5, None, None)
    assert summary["nonfinite_steps"] == 3 and summary["checkpoint"] == step2

    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows[:2])
    assert [(r["loss"], r["grad_norm"]) for r in rows[2:]] == [(None, None)] * 3  # JSON has no nan
    assert board_scalars(out / "tensorboard", "train/nonfinite_steps") == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
    assert [step for step, _ in board_scalars(out / "tensorboard", "train/loss")] == [1, 2]
