"""One writer per output directory: DIR/.<command>.lease names the run that owns it.

stk-train takes it on --output-dir: two runs on one directory would overwrite each other's
metrics, checkpoints and final model, and each summary would point at the other's weights.
stk-cache takes it on a local --out (and `verify --repair` on the cache it rewrites): two builds
would both encode everything, and each manifest would unlist the other's shards. stk-scan takes it on
--out: two scans would rename each other's journal and state files (one died on a state file the other
had taken), or the last to finish would replace the other's table, silently. The lease is a
small JSON file (host, pid, Slurm job id and restart count, run id), created with `os.link` from
a private temp file: link is atomic on NFS as on local disk, where fcntl/flock locks are
unreliable or absent. Rank 0 renews it (rewrites it, which moves its mtime) every
`HEARTBEAT_SECONDS` while the run lives.

An s3:// --out has no lease: a takeover needs an atomic rename or a conditional delete, which not
every S3-compatible store has. Run one stk-cache per s3:// --out (docs/commands/stk-cache.md).

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
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from stk.cluster.slurm import job_id, restart_count
from stk.cluster.world import World
from stk.errors import InputError, PreflightFailed
from stk.log import get_logger

__all__ = ["HEARTBEAT_SECONDS", "STALE_SECONDS", "Holder", "Lease", "lease_name", "leased"]

log = get_logger("lease")

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


def lease_name(command: str) -> str:
    """The lease file's name in the directory `command` writes: `.stk-train.lease`."""
    return f".{command}.lease"


class Lease:
    """A directory's lease for `command` (given to the user as `option`, the option naming the
    directory), held by this process from `acquire` until `release`."""

    def __init__(self, directory: str, command: str, option: str, holder: Holder | None = None) -> None:
        self.path = os.path.join(directory, lease_name(command))
        self.command, self.option = command, option
        self.holder = holder or Holder.this_process()
        self._made_directory = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, or raise PreflightFailed naming the live run that holds it (InputError: the directory is
        a file)."""
        directory = os.path.dirname(self.path)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise InputError(f"{self.option} {directory}: is a file, not a directory: give a directory")
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
            self._made_directory = True
        for _ in range(3):  # a takeover can lose a race to another run: look again
            if self._create():
                return
            current, age = self._read()
            if current is None:
                continue  # released between our try and our look
            if self._alive(current, age):
                raise PreflightFailed(
                    f"{self.option} {os.path.dirname(self.path)} is in use by another {self.command} run "
                    f"({current.describe()}, renewed {age:.0f} s ago): wait for it to end or use another {self.option} "
                    f"(a run that died frees it after {STALE_SECONDS:.0f} s)"
                )
            self._take_over(current)
        raise PreflightFailed(f"{self.path}: other runs keep taking this lease; start one run per {self.option}")

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="stk-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours, and the directory if `acquire`
        made it and nothing else was written there (a run that failed early leaves nothing behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current, _ = self._read()
        if current is not None and current.run == self.holder.run:
            os.unlink(self.path)
        if self._made_directory:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

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
            return _running(current.pid)
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


@contextlib.contextmanager
def leased(lease: Lease | None, world: World | None = None) -> Iterator[None]:
    """Hold `lease` (None: nothing to hold) for the block, renewed, on rank 0 of `world` (or in this
    process when there is no world); a refusal is raised on every rank."""
    if lease is None:
        yield
        return
    root = world is None or world.is_root
    if world is None:
        lease.acquire()
    else:
        world.root_call(lease.acquire)
    try:
        if root:
            lease.start_heartbeat()
        yield
    finally:
        if root:
            lease.release()


def _running(pid: int) -> bool:
    """Whether process `pid` of this host still runs. A process killed with its job (an MPI abort) can stay a zombie
    until its new parent reaps it: it answers signal 0, but it holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except (OSError, IndexError):  # no /proc (or it vanished): signal 0's answer stands
        return True
    return state not in ("Z", "X")
