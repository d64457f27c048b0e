"""The status directory: how the ranks on stk-launch's node tell it that they run and how they
ended, since DeepSpeed's MPI launcher loses their exit codes (see stk.launch)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stk.cluster.world import on_abort
from stk.errors import ExitCode
from stk.log import get_logger

__all__ = ["RANK_STATUS_ENV", "RankStatus", "job_exit_code", "read_ranks", "run_rank"]

log = get_logger("launch")

RANK_STATUS_ENV = "STK_RANK_STATUS_DIR"
RUNNING = "running"


@dataclass(frozen=True)
class RankStatus:
    """One rank's line in the status directory: where it runs, and its exit code once it ended."""

    host: str
    pid: int
    code: int | None  # None: still running, or killed before it could write one


def run_rank(argv: Sequence[str], main: Callable[..., object]) -> int:
    """Run stk-train's `main` in this process, registered in $STK_RANK_STATUS_DIR as HOST-PID
    while it runs and with its exit code once it ends. Only the launching node has that
    directory: elsewhere nothing is written."""
    directory = os.environ.get(RANK_STATUS_ENV, "")
    status = os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}") if os.path.isdir(directory) else None
    _write_status(status, RUNNING)
    on_abort(lambda code: _write_status(status, str(code)))  # MPI_Abort ends the process: no finally
    code = int(ExitCode.INTERNAL)
    try:
        main(args=list(argv), prog_name="stk-train")
        code = 0
    except SystemExit as exc:
        code = int(exc.code) if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        _write_status(status, str(code))
    return code


def _write_status(path: str | None, text: str) -> None:
    if path is None:
        return
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def read_ranks(status_dir: str) -> list[RankStatus]:
    """The ranks that registered in `status_dir` (files named HOST-PID, holding "running" or the
    rank's exit code)."""
    ranks = []
    for entry in os.scandir(status_dir):
        host, _, pid = entry.name.rpartition("-")
        if entry.name.startswith(".") or not pid.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError), open(entry.path) as f:
            text = f.read().strip()
            ranks.append(RankStatus(host, int(pid), int(text) if text.lstrip("-").isdigit() else None))
    return ranks


def job_exit_code(launcher_code: int, rank_codes: Sequence[int | None]) -> int:
    """The job's code: a rank's error (the highest), else the infrastructure code if a rank ended
    without one (killed: a rerun resumes), else the GPU-fault code, else the requeue code, else the
    launcher's own code."""
    ended = [c for c in rank_codes if c is not None]
    errors = [c for c in ended if c not in (ExitCode.OK, ExitCode.REQUEUE, ExitCode.GPU_FAULT)]
    if errors:
        return max(errors)
    if None in rank_codes:  # killed: a node lost, the OOM killer, or the launcher ending them after a peer died
        log.error(
            "%d rank(s) on this node were killed before they could exit (a peer or its node was lost?): exit %d, "
            "a rerun resumes from the last checkpoint",
            rank_codes.count(None),
            ExitCode.INFRA,
        )
        return int(ExitCode.INFRA)
    for code in (ExitCode.GPU_FAULT, ExitCode.REQUEUE):
        if code in ended:
            return int(code)
    return launcher_code
