"""DeepSpeed's op builds, end to end: real stk-train jobs (mpiexec -n 2, DeepSpeed on the CPU) against the session's
build directory while this process holds the build lock and a torch baton as a build does; and `make install`'s
build step. The lock itself: tests/unit/train/deepspeed/test_opbuilds.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import EXTENSIONS_DIR, FAST, run_train, train_command, train_env
from support.opbuilds import SHM_OP, STOPPED_EARLY, baton, building
from support.processes import mpi_rank_pids

from stk.errors import ExitCode
from stk.models import Family
from stk.train.deepspeed import opbuilds
from stk.train.deepspeed.opbuilds import (
    LOCK_NAME,
    WAIT_ENV,
)

# --- the build lock -----------------------------------------------------------------------------------------------


# --- real stk-train runs --------------------------------------------------------------------------------------------


def wait_until_waiting(pids: list[int], proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Until every process in `pids` has the build lock open (it waits for it), or fail if `proc` ended first."""
    lock = os.path.realpath(EXTENSIONS_DIR / LOCK_NAME)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if all(lock in open_files(pid) for pid in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not reach the build lock (exit {proc.poll()})")


def open_files(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we look
            found.add(os.readlink(fd))
    return found


def rank_pids(proc: subprocess.Popen[str], ranks: int) -> list[int]:
    deadline = time.monotonic() + 60
    while len(found := mpi_rank_pids(proc.pid, "stk.cli.train")) < ranks and time.monotonic() < deadline:
        time.sleep(0.1)
    return [found[r] for r in range(ranks)]


def train_args(setups, tmp_path: Path, *extra: str) -> list[str]:
    model, cache = setups(Family.SD)
    return ["--cache", cache, "--model", model, "--output-dir", tmp_path / "run", *FAST, *extra]


@pytest.mark.integration
def test_stale_batons_left_by_killed_builds_do_not_stop_the_next_run(setups, tmp_path):
    """A killed build's torch baton for the shared-memory op (init_distributed) and for CPU Adam (the offloaded
    optimizer, built in deepspeed.initialize): the next run removes them, saying so, and trains."""
    stale = [baton(EXTENSIONS_DIR, op) for op in (SHM_OP, "cpu_adam")]
    for path in stale:
        path.touch()
    proc = run_train(train_args(setups, tmp_path, "--max-steps", "1", "--deepspeed", "zero2-offload"), timeout=540)
    assert proc.returncode == 0, proc.stderr  # at worst after one cold build of each
    assert not any(path.exists() for path in stale)
    assert all(f"removed {path}, left by a build that was killed" in proc.stderr for path in stale), proc.stderr


@pytest.mark.integration
def test_a_run_waits_for_a_live_build_beside_it_then_trains(setups, tmp_path):
    args = train_args(setups, tmp_path, "--max-steps", "1")
    proc = subprocess.Popen(
        train_command(args, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env()
    )
    try:
        with building() as live:
            wait_until_waiting(rank_pids(proc, 2), proc)
            time.sleep(opbuilds._SAY_WAITING_AFTER_S + 1)
            assert live.exists() and proc.poll() is None  # neither taken for a stale one nor gone past
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert stderr.count(f"waiting for another process's build of DeepSpeed's ops in {EXTENSIONS_DIR}") == 2, stderr
    assert "removed" not in stderr


@pytest.mark.integration
def test_a_wait_past_the_bound_is_exit_69_naming_the_directory(setups, tmp_path):
    proc = subprocess.Popen(
        train_command(train_args(setups, tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**train_env(), WAIT_ENV: "2"},
    )
    try:
        with building():
            _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.INFRA, stderr
    lines = [line for line in stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and f"of DeepSpeed's ops in {EXTENSIONS_DIR} (pid {os.getpid()}" in lines[0], stderr


@pytest.mark.integration
def test_sigterm_while_waiting_for_a_build_ends_the_run_at_once_for_requeue(setups, tmp_path):
    proc = subprocess.Popen(
        train_command(train_args(setups, tmp_path), 2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=train_env(),
    )
    try:
        with building():
            ranks = rank_pids(proc, 2)
            wait_until_waiting(ranks, proc)
            started = time.monotonic()
            os.kill(ranks[1], signal.SIGTERM)  # one rank: mpiexec ends the other
            _, stderr = proc.communicate(timeout=60)
            elapsed = time.monotonic() - started
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.REQUEUE, stderr
    assert elapsed < 10, elapsed
    assert stderr.count(STOPPED_EARLY) == 1 and "SIGTERM" in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.integration
def test_make_installs_step_builds_the_ops_stk_uses(tmp_path):
    """`python -m stk.train.deepspeed.opbuilds` (make install) into the session's directory: the shared-memory op and
    CPU Adam, where TORCH_EXTENSIONS_DIR says, not in the default directory."""
    env = {**train_env(), "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "stk.train.deepspeed.opbuilds"], capture_output=True, text=True, env=env, timeout=540
    )
    assert proc.returncode == 0, proc.stderr
    assert f"stk: DeepSpeed's ops {SHM_OP}, cpu_adam ready in {EXTENSIONS_DIR} (" in proc.stdout, proc.stdout
    assert all((EXTENSIONS_DIR / op / f"{op}.so").is_file() for op in (SHM_OP, "cpu_adam"))
    assert not (tmp_path / "stk").exists()  # TORCH_EXTENSIONS_DIR given: the default is not used
