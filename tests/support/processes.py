"""The processes and threads a run leaves: an MPI run's ranks read from /proc, killed at a chosen moment,
and stk's loader threads."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (mpiexec -> hydra proxy -> ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_ended(pid: int, timeout: float) -> bool:
    """Whether `pid` has exited (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


def mpi_rank_pids(mpiexec_pid: int, module: str) -> dict[int, int]:
    """{rank: pid} of the `python -m MODULE` processes that mpiexec started."""
    ranks = {}
    for pid in descendant_pids(mpiexec_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() not in cmdline or any(part.endswith(b"mpiexec") for part in cmdline):
            continue
        for item in environ:
            if item.startswith(b"PMI_RANK="):
                ranks[int(item.split(b"=", 1)[1])] = pid
    return ranks


def kill_cache_ranks_when(
    command: list[str], env: dict[str, str], ready: Callable[[], bool], what: str, victims: tuple[int, ...]
) -> subprocess.CompletedProcess[str]:
    """Run a 2-rank stk-cache, SIGKILL the `victims` ranks once `ready()` holds (`what` names that
    moment in a failure), and return the finished run; nothing of it is left running."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, f"the build ended before it could be killed: {proc.communicate()}"
            assert time.monotonic() < deadline, f"{what} after 120 s"
            time.sleep(0.01)
        ranks = mpi_rank_pids(proc.pid, "stk.cli.cache")
        assert sorted(ranks) == [0, 1], ranks
        for victim in victims:
            os.kill(ranks[victim], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("stk-load", "stk-prefetch"))]
