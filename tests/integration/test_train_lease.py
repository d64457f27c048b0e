"""One stk-train run per output directory (the lease), end to end: two real stk-train jobs (mpiexec -n 2, DeepSpeed
on the CPU) on one output directory, and a resume with other settings refused unless overridden."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.commands import FAST, LEASE_NAME, run_train, summary_of, train_command, train_env
from support.processes import mpi_rank_pids
from support.train_outputs import board_scalars, board_tags, metrics

from stk.errors import ExitCode, InputError, PreflightFailed
from stk.models import Family

# --- end to end ---------------------------------------------------------------------------------


def wait_for_steps(out: Path, steps: int, proc: subprocess.Popen[str], limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(metrics(out)) >= steps:
            return
        time.sleep(0.2)
    if proc.poll() is None:
        raise AssertionError(f"training did not reach step {steps} in {limit} s")
    raise AssertionError(f"training ended (exit {proc.returncode}) before step {steps}: {proc.communicate()[1]}")


def start_long_run(setups, out: Path, checkpoint_every: int) -> tuple[list[object], subprocess.Popen[str]]:
    """A 2-rank run long enough to be interfered with, in its own session (killpg ends every rank)."""
    model, cache = setups(Family.SD)
    args = [
        "--cache",
        cache,
        "--model",
        model,
        "--output-dir",
        out,
        "--epochs",
        "100",
        "--checkpoint-every",
        str(checkpoint_every),
        *FAST,
    ]
    proc = subprocess.Popen(
        train_command(args, 2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=train_env(),
        start_new_session=True,
    )
    return args, proc


@pytest.mark.integration
def test_a_second_run_on_a_busy_output_dir_is_refused_and_the_first_goes_on(setups, tmp_path):
    out = tmp_path / "run"
    args, first = start_long_run(setups, out, checkpoint_every=0)
    try:
        wait_for_steps(out, 2, first)
        started = time.monotonic()
        second = run_train([*args, "--max-steps", "3"])
        refused_in = time.monotonic() - started
        assert first.poll() is None, "the first run ended while the second was refused: make it longer"
        os.kill(mpi_rank_pids(first.pid, "stk.cli.train")[0], signal.SIGUSR2)  # end the first at a checkpoint
        stdout, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == PreflightFailed.exit_code, second.stderr
    assert second.stderr.count("in use by another stk-train run (host ") == 1, second.stderr
    assert refused_in < 120  # refused in preflight, before any model loads
    assert first.returncode == ExitCode.REQUEUE, stderr
    steps = [row["step"] for row in metrics(out)]
    assert steps == list(range(1, json.loads(stdout)["steps"] + 1))  # the second run wrote nothing
    assert not (out / LEASE_NAME).exists()


@pytest.mark.integration
def test_a_killed_runs_lease_is_taken_over_and_the_rerun_resumes(setups, tmp_path):
    out = tmp_path / "run"
    args, first = start_long_run(setups, out, checkpoint_every=2)
    try:
        wait_for_steps(out, 3, first)
        os.killpg(first.pid, signal.SIGKILL)  # every rank and mpiexec, as a node failure would
        first.wait(timeout=60)
    finally:
        first.kill()
    assert (out / LEASE_NAME).exists()
    resumed_at = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    rerun = run_train([*args[: args.index("--epochs")], "--max-steps", str(resumed_at + 2), *FAST])
    assert rerun.returncode == 0, rerun.stderr
    assert "took over" in rerun.stderr
    assert summary_of(rerun)["steps"] == resumed_at + 2
    assert [row["step"] for row in metrics(out)] == list(range(1, resumed_at + 3))


@pytest.mark.integration
def test_resuming_with_other_settings_is_refused_unless_overridden(copied):
    """On a copy of the session's `trained` run (4 steps, seed 0, lr 1e-3)."""
    args, out = copied
    base = [*args, "--output-dir", out]
    started = time.monotonic()
    refused = run_train([*base, "--max-steps", "6", "--seed", "5", "--lr", "5e-4"])
    assert refused.returncode == InputError.exit_code, refused.stderr
    assert "seed 0 -> 5, lr 0.001 -> 0.0005" in refused.stderr and "--override-resume" in refused.stderr
    assert time.monotonic() - started < 120
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4]  # nothing trained, nothing overwritten

    changed = run_train([*base, "--max-steps", "6", "--lr", "5e-4", "--seed", "5", "--override-resume"])
    assert changed.returncode == 0, changed.stderr
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert [row["lr"] for row in rows] == [1e-3] * 4 + [5e-4] * 2  # the new lr from the resumed step on
    # TensorBoard (the default report) shows the same curves: each step once across the two runs
    assert board_scalars(out / "tensorboard", "train/lr") == [(r["step"], pytest.approx(r["lr"])) for r in rows]
    assert {"train/loss", "train/grad_norm", "train/samples_per_s", "train/step_time", "train/data_wait"} <= set(
        board_tags(out / "tensorboard")
    )
