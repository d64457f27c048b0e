"""One stk-train run per output directory: OUTPUT/.stk-train.lease names the run that owns it.

Two runs on one directory would overwrite each other's metrics, checkpoints and final model, and
each summary would point at the other's weights. The lease is a small JSON file (host, pid, Slurm
job id and restart count, run id), created with `os.link` from a private temp file: link is
atomic on NFS as on local disk, where fcntl/flock locks are unreliable or absent. Rank 0 renews it
(rewrites it, which moves its mtime) every `HEARTBEAT_SECONDS` while the run lives.

A lease whose holder is gone is taken over: an earlier attempt of the same Slurm job (a requeued
job never runs twice at once), a process on this host that no longer exists, or a lease not
renewed for `STALE_SECONDS` (a holder on another node that died with its node). The takeover
moves the old file aside under a unique name first, so of two runs taking over at once only one
wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from stk.errors import PreflightFailed
from stk.log import get_logger
from stk.slurm import job_id, restart_count

__all__ = ["HEARTBEAT_SECONDS", "LEASE_NAME", "STALE_SECONDS", "Holder", "Lease"]

log = get_logger("train.lease")

LEASE_NAME = ".stk-train.lease"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 180.0  # six missed renewals: past any NFS attribute cache or a long GC pause


@dataclass(frozen=True)
class Holder:
    """Who holds the lease."""

    host: str
    pid: int
    run: str  # unique per run: tells our lease from a successor's
    job_id: str | None  # the Slurm job's
    restart: int  # a requeued job's later attempt has a higher one

    @classmethod
    def this_process(cls) -> Holder:
        environ = os.environ
        return cls(socket.gethostname(), os.getpid(), uuid.uuid4().hex, job_id(environ), restart_count(environ))

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}{job}"


class Lease:
    """The output directory's lease, held by this process from `acquire` until `release`."""

    def __init__(self, output_dir: str, holder: Holder | None = None) -> None:
        self.path = os.path.join(output_dir, LEASE_NAME)
        self.holder = holder or Holder.this_process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, or raise PreflightFailed naming the live run that holds it."""
        for _ in range(3):  # a takeover can lose a race to another run: look again
            if self._create():
                return
            current, age = self._read()
            if current is None:
                continue  # released between our try and our look
            if self._alive(current, age):
                raise PreflightFailed(
                    f"--output-dir {os.path.dirname(self.path)} is in use by another stk-train run "
                    f"({current.describe()}, renewed {age:.0f} s ago): wait for it to end or use another --output-dir "
                    f"(a run that died frees it after {STALE_SECONDS:.0f} s)"
                )
            self._take_over(current)
        raise PreflightFailed(f"{self.path}: other runs keep taking this lease; start one run per --output-dir")

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="stk-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current, _ = self._read()
        if current is not None and current.run == self.holder.run:
            os.unlink(self.path)

    def _create(self) -> bool:
        temp = self._write_temp()
        try:
            os.link(temp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def _write_temp(self) -> str:
        temp = f"{self.path}.{self.holder.run}.tmp"
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(asdict(self.holder), f)
            f.flush()
            os.fsync(f.fileno())
        return temp

    def _read(self, path: str | None = None) -> tuple[Holder | None, float]:
        """The holder named in the lease and seconds since its last renewal; (None, 0) if absent."""
        path = path or self.path
        try:
            with open(path, encoding="utf-8") as f:
                data: dict[str, Any] = json.load(f)
                age = time.time() - os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None, 0.0
        except (OSError, ValueError, TypeError):  # torn or foreign: judged by its age alone
            return Holder("?", -1, "?", None, 0), time.time() - os.stat(path).st_mtime
        return Holder(**data), age

    def _alive(self, current: Holder, age: float) -> bool:
        mine = self.holder
        if mine.job_id and current.job_id == mine.job_id and current.restart < mine.restart:
            return False  # an earlier attempt of this requeued job
        if age > STALE_SECONDS:
            return False
        if current.host == mine.host and current.pid != mine.pid:
            try:
                os.kill(current.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return True

    def _take_over(self, dead: Holder) -> None:
        """Move the dead run's lease aside (only one mover can succeed), check it was the one we
        judged, and leave the name free for `_create`."""
        aside = f"{self.path}.{self.holder.run}.dead"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run moved it first
        moved, _ = self._read(aside)
        if moved is not None and moved.run != dead.run:  # a live successor's lease: put it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            os.unlink(aside)
            return
        os.unlink(aside)
        log.warning("took over %s from a run that is gone (%s)", self.path, dead.describe())

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            current, _ = self._read()
            if current is None or current.run != self.holder.run:
                taker = current.describe() if current else "nobody"
                log.error("lost the lease on %s to %s, which owns it now (this run did not renew it)", self.path, taker)
                return
            os.replace(self._write_temp(), self.path)
