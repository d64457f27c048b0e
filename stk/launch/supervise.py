"""Running a launch: write the hostfile, start the launcher as a child, pass stop requests on to
the ranks, and return the job's exit code."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import TextIO

from stk.cluster.slurm import STOP_SIGNALS
from stk.errors import ExitCode, InfraError
from stk.launch.plan import Launch
from stk.launch.status import RANK_STATUS_ENV, job_exit_code, read_ranks
from stk.log import get_logger
from stk.storage import write_atomic

__all__ = ["execute", "run_ranks", "supervise"]

log = get_logger("launch")


def execute(launch: Launch, environ: Mapping[str, str], dry_run: bool = False, out: TextIO | None = None) -> int:
    """Write the hostfile, then print the launch (dry run) or run it and return the job's code."""
    if launch.hostfile:
        write_atomic(launch.hostfile, launch.allocation.hostfile().encode())
    alloc = launch.allocation
    log.info(
        "%d host(s) x %d rank(s) via %s, rendezvous %s:%s: %s",
        len(alloc.hosts),
        alloc.slots,
        launch.via,
        launch.env["STK_MASTER_ADDR"],
        launch.env["STK_MASTER_PORT"],
        shlex.join(launch.command),
    )
    if dry_run:
        (out or sys.stdout).write(launch.script())
        return int(ExitCode.OK)
    env = {**environ, **launch.env}
    if launch.via == "srun":
        return supervise(launch.command, env)
    if shutil.which("mpirun", path=env.get("PATH")) is None:
        raise InfraError("mpirun not found on PATH: load the MPI that mpi4py was built with, or use --via srun")
    return run_ranks(launch.command, env)


def run_ranks(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run a launcher whose ranks start through `run_rank`, and return the job's code from the
    codes the ranks on this node recorded (the launcher's own code where none did)."""
    status_dir = tempfile.mkdtemp(prefix="stk-launch-")
    try:
        code = supervise(command, {**env, RANK_STATUS_ENV: status_dir}, status_dir)
        return job_exit_code(code, [rank.code for rank in read_ranks(status_dir)])
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def supervise(command: Sequence[str], env: Mapping[str, str], status_dir: str | None = None) -> int:
    """Run the launcher and return its exit code (128 + N when signal N killed it). SIGUSR2 and
    SIGTERM meanwhile become SIGUSR2 to the ranks running on this node that registered in
    `status_dir` (once one of them handles it), or without one to the launcher itself (srun,
    which passes it to every task)."""
    requests: list[str] = []

    def request(signum: int, _frame: object) -> None:
        requests.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request) for sig in STOP_SIGNALS}
    try:
        try:
            child = subprocess.Popen(list(command), env=dict(env))
        except OSError as exc:
            raise InfraError(f"cannot run {command[0]}: {exc.strerror}") from exc
        code: int | None = None
        waiting = False  # a request is held until a rank can take it
        while code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=0.2)
            if requests and code is None:
                received = requests[-1]
                if status_dir is None:
                    log.warning("%s received: passing SIGUSR2 to srun, which passes it to every task", received)
                    child.send_signal(signal.SIGUSR2)
                elif not _stop_ranks(status_dir, received):
                    if not waiting:
                        log.warning("%s received: no rank on this node handles SIGUSR2 yet; waiting", received)
                    waiting = True
                    continue
                requests.clear()
                waiting = False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _stop_ranks(status_dir: str, received: str) -> bool:
    """SIGUSR2 to the running ranks of this node that handle it; whether there was any. Ranks are
    found through their status files, not the process tree: inside an allocation MPICH's mpirun
    starts them through srun, under slurmstepd, not below stk-launch."""
    host = socket.gethostname()
    running = [r.pid for r in read_ranks(status_dir) if r.host == host and r.code is None]
    pids = [pid for pid in running if _catches(pid, signal.SIGUSR2)]
    if pids:
        log.warning("%s received: asking %d rank(s) on this node to checkpoint (SIGUSR2)", received, len(pids))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    return bool(pids)


def _catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (SigCgt in /proc/PID/status): a rank still starting
    has none yet, and an unhandled SIGUSR2 would kill it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(caught >> (sig - 1) & 1)
