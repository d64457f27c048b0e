"""One stk-train run per output directory (the lease), and resumes that would change the run.

Unit tests drive the lease file with holders that stand for other processes and hosts; the end-to-end
tests run two real stk-train jobs (mpiexec -n 2, DeepSpeed on the CPU) on one output directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from support.helpers import (
    FAST,
    board_scalars,
    board_tags,
    metrics,
    mpi_rank_pids,
    run_train,
    summary_of,
    train_command,
    train_env,
)

from stk.errors import ExitCode, InputError, PreflightFailed
from stk.lease import STALE_SECONDS, Holder, Lease, lease_name
from stk.models import Family
from stk.train.checkpoint import CheckpointDir, Resume
from stk.train.lora import LoraSettings
from stk.train.options import TrainOptions

LEASE_NAME = lease_name("stk-train")


def other(host: str = "elsewhere", pid: int = 4242, job: str | None = None, restart: int = 0) -> Holder:
    return Holder(host, pid, f"run-{host}-{pid}", job, restart)


def write_lease(output: Path, holder: Holder, age: float = 0.0) -> Path:
    path = output / LEASE_NAME
    path.write_text(json.dumps(asdict(holder)))
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_acquire_writes_who_holds_it_and_release_removes_it(tmp_path):
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    held = json.loads((tmp_path / LEASE_NAME).read_text())
    assert held["pid"] == os.getpid() and held["host"] == lease.holder.host and held["run"] == lease.holder.run
    lease.release()
    assert not (tmp_path / LEASE_NAME).exists()
    assert os.listdir(tmp_path) == []  # no temp files left behind


def test_a_live_holder_elsewhere_is_refused_with_its_host_pid_and_job(tmp_path):
    path = write_lease(tmp_path, other(job="1234"))
    with pytest.raises(PreflightFailed, match=r"another stk-train run \(host elsewhere, pid 4242, Slurm job 1234"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()
    assert json.loads(path.read_text())["run"] == "run-elsewhere-4242"  # untouched


def test_a_live_process_on_this_host_is_refused(tmp_path):
    mine = Holder.this_process()
    write_lease(tmp_path, replace(other(host=mine.host, pid=os.getppid())))
    with pytest.raises(PreflightFailed, match="in use"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()


def test_a_dead_process_on_this_host_loses_its_lease(tmp_path):
    mine = Holder.this_process()
    write_lease(tmp_path, other(host=mine.host, pid=dead_pid()))
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == lease.holder.run
    assert sorted(os.listdir(tmp_path)) == [LEASE_NAME]


def test_a_lease_not_renewed_for_the_stale_time_is_taken_over(tmp_path):
    write_lease(tmp_path, other(), age=STALE_SECONDS + 5)
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == lease.holder.run


def test_an_earlier_attempt_of_the_same_requeued_slurm_job_is_taken_over(tmp_path):
    write_lease(tmp_path, other(job="77", restart=0))
    me = replace(Holder.this_process(), job_id="77", restart=1)
    Lease(str(tmp_path), "stk-train", "--output-dir", me).acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == me.run
    # the same attempt (another step of the same allocation) is a live run: refused
    write_lease(tmp_path, other(job="78", restart=1))
    with pytest.raises(PreflightFailed):
        Lease(str(tmp_path), "stk-train", "--output-dir", replace(me, job_id="78")).acquire()


def test_a_torn_lease_is_judged_by_its_age(tmp_path):
    (tmp_path / LEASE_NAME).write_text("{not json")
    with pytest.raises(PreflightFailed, match=r"host \?"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()
    then = time.time() - STALE_SECONDS - 5
    os.utime(tmp_path / LEASE_NAME, (then, then))
    Lease(str(tmp_path), "stk-train", "--output-dir").acquire()


def test_release_leaves_a_successors_lease_alone(tmp_path):
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    write_lease(tmp_path, other())  # taken over while this run was frozen
    lease.release()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == "run-elsewhere-4242"


# --- the settings a checkpoint was trained with -------------------------------------------


def settings(world_size: int = 2, **changes: object) -> dict[str, object]:
    return replace(TrainOptions(model="m", output_dir="o"), **changes).run_settings(Family.SDXL, world_size)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointDir, Resume]:
    checkpoints = CheckpointDir(str(tmp_path), keep=1, rank=0)
    (tmp_path / "checkpoints" / "step-00000005").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000005" / "stk-run.json").write_text(json.dumps(settings()))
    return checkpoints, Resume(checkpoints.path, "step-00000005")


def test_same_settings_resume_quietly(saved):
    checkpoints, resume = saved
    assert checkpoints.check_settings(resume, settings(), override=False) == []


def test_other_seed_or_batch_is_refused_naming_old_and_new(saved):
    checkpoints, resume = saved
    with pytest.raises(InputError, match=r"seed 0 -> 3, batch-size 4 -> 2\).*--override-resume"):
        checkpoints.check_settings(resume, settings(seed=3, batch_size=2), override=False)


def test_another_split_of_the_same_effective_batch_is_no_change(saved):
    checkpoints, resume = saved  # 2 ranks x 4 x 1
    assert checkpoints.check_settings(resume, settings(world_size=1, grad_accum=2), override=False) == []
    with pytest.raises(InputError, match=r"grad-accum 1 -> 2, world-size 2 -> 3\).*--override-resume"):
        checkpoints.check_settings(resume, settings(world_size=3, grad_accum=2), override=False)
    assert checkpoints.check_settings(resume, settings(world_size=3), override=True) == ["world_size"]


def test_override_returns_what_changed(saved):
    checkpoints, resume = saved
    assert checkpoints.check_settings(resume, settings(seed=3), override=True) == ["seed"]


def test_another_family_is_refused_even_with_override(saved):
    checkpoints, resume = saved
    flux = {**settings(), "family": Family.FLUX.value}
    with pytest.raises(InputError, match="other weights"):
        checkpoints.check_settings(resume, flux, override=True)


def test_a_full_checkpoint_resumed_as_a_lora_is_refused_even_with_override(saved):
    checkpoints, resume = saved
    with pytest.raises(InputError, match=re.escape("it holds other weights (lora-rank 0 -> 16)")):
        checkpoints.check_settings(resume, settings(lora=LoraSettings(rank=16)), override=True)


@pytest.fixture
def saved_lora(saved: tuple[CheckpointDir, Resume], tmp_path: Path) -> tuple[CheckpointDir, Resume]:
    record = tmp_path / "checkpoints" / "step-00000005" / "stk-run.json"
    record.write_text(json.dumps(settings(lora=LoraSettings(rank=16))))
    return saved


@pytest.mark.parametrize(
    ("lora", "differs"),
    [
        (LoraSettings(), "lora-rank 16 -> 0"),
        (LoraSettings(rank=8), "lora-rank 16 -> 8, lora-alpha 16 -> 8"),  # alpha: the rank, unless given
        (LoraSettings(rank=16, targets=("to_q",)), "lora-targets ['to_k', 'to_out.0', 'to_q', 'to_v'] -> ['to_q']"),
    ],
)
def test_a_lora_checkpoint_resumed_with_other_adapter_weights_is_refused_even_with_override(saved_lora, lora, differs):
    checkpoints, resume = saved_lora
    with pytest.raises(InputError, match=re.escape(f"it holds other weights ({differs})")):
        checkpoints.check_settings(resume, settings(lora=lora), override=True)


def test_a_lora_resumed_with_another_alpha_needs_override_like_any_setting(saved_lora):
    checkpoints, resume = saved_lora
    other = settings(lora=LoraSettings(rank=16, alpha=32))
    with pytest.raises(InputError, match=re.escape("lora-alpha 16 -> 32") + ".*--override-resume"):
        checkpoints.check_settings(resume, other, override=False)
    assert checkpoints.check_settings(resume, other, override=True) == ["lora_alpha"]


def test_checkpoints_without_the_record_are_not_checked(saved, tmp_path):
    checkpoints, resume = saved
    (tmp_path / "checkpoints" / "step-00000005" / "stk-run.json").unlink()
    assert checkpoints.check_settings(resume, settings(seed=9), override=False) == []


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
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--epochs", "100",
            "--checkpoint-every", str(checkpoint_every), *FAST]  # fmt: skip
    proc = subprocess.Popen(train_command(args, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=train_env(), start_new_session=True)  # fmt: skip
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
def test_resuming_with_other_settings_is_refused_unless_overridden(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    base = ["--cache", cache, "--model", model, "--output-dir", out, *FAST]
    assert run_train([*base, "--max-steps", "2"]).returncode == 0
    started = time.monotonic()
    refused = run_train([*base, "--max-steps", "4", "--seed", "5", "--lr", "5e-4"])
    assert refused.returncode == InputError.exit_code, refused.stderr
    assert "seed 0 -> 5, lr 0.001 -> 0.0005" in refused.stderr and "--override-resume" in refused.stderr
    assert time.monotonic() - started < 120
    assert [row["step"] for row in metrics(out)] == [1, 2]  # nothing trained, nothing overwritten

    changed = run_train([*base, "--max-steps", "4", "--lr", "5e-4", "--seed", "5", "--override-resume"])
    assert changed.returncode == 0, changed.stderr
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["lr"] for row in rows] == [1e-3, 1e-3, 5e-4, 5e-4]  # the new lr from the resumed step on
    # TensorBoard (the default report) shows the same curves: each step once across the two runs
    assert board_scalars(out / "tensorboard", "train/lr") == [(r["step"], pytest.approx(r["lr"])) for r in rows]
    assert {"train/loss", "train/grad_norm", "train/samples_per_s", "train/step_time", "train/data_wait"} <= set(
        board_tags(out / "tensorboard")
    )
