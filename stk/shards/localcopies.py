"""Whole shards of an s3:// cache on node-local disk, fetched on first use, shared by a node's ranks.

Random reads want a local file (one ranged GET per record would cost milliseconds), so a reader
downloads a whole shard the first time it needs a record from it, or ahead of time (prefetch).
Files are named after the shard's checksum as well as its name, so a directory kept between jobs,
or shared by the ranks of a node (one `--local-cache-dir` for all), is reused: a copy under its
final name was checked against the manifest (size, and sha256 unless `check_sha256` is off)
before it got that name.

Sharing a directory between processes:

- A download goes to a temp folder (`.part-*`) that its process holds locked, is checked, and is
  hard-linked to its final name. The link fails when another process got there first (its copy
  is then used), so a copy appears whole or not at all, and a name never changes its file while
  it exists. A process that opens the directory removes the temp folders nobody holds: those of
  killed downloads.
- Each process holds a lease on every copy it uses: a shared `flock` on a descriptor of its own.
  Eviction takes an exclusive `flock` without waiting and deletes the file only when it gets it,
  so a copy is never deleted while any process holds it.
- A process that opens a copy just as it is deleted sees, once its shared lock is granted, that
  the name no longer points at the file it locked, and fetches again (a few times at most).

Why flock: the kernel drops a process's locks when it ends, kill -9 included, so there are no
stale leases to expire or clean up; and a flock belongs to the open file description, so h5py
opening and closing the same file does not release it (any close by the process would release a
POSIX fcntl lock). flock is local to the node: the directory must be on node-local disk, which is
what it is for (on NFS, Linux emulates flock with fcntl locks, with that flaw).

Size limit: `max_bytes` counts every copy in the directory, whoever fetched it, so ranks sharing a
directory share its limit. Past it, copies that no process holds go first, least recently used
first (a copy's mtime is set whenever a process takes a lease on it); then this process gives up
its own least recently used leases (never the copy just asked for) and deletes the copies no
other process holds. Copies in use stay, so copies in use and downloads in flight (at most one
per thread) can take the directory past the limit.

Thread-safe. Two threads asking for the same shard share one download. The lock here guards the
bookkeeping only: it is never held during a download nor while `on_evict` runs, since `on_evict`
takes the reader's lock and a reader may call in here while holding that lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from stk import storage
from stk.errors import InfraError
from stk.log import get_logger
from stk.shards.integrity import damaged, problem
from stk.shards.staging import locked_temp_dir, remove_stale

__all__ = ["LocalCopies"]

log = get_logger("shards")
COPY_NAME = re.compile(r"[0-9a-f]{16}-[^/]+\.h5")  # the only files eviction ever deletes
PART_PREFIX = ".part-"  # a download's temp folder
TRIES = 5  # fetches of one shard that another process deletes before this one holds it


class LocalCopies:
    def __init__(self, directory: str | None, max_bytes: int | None, check_sha256: bool = True) -> None:
        self._owner = os.getpid() if directory is None else None  # a temp dir is this process's to delete
        self.directory = directory or tempfile.mkdtemp(prefix="stk-shards-")
        os.makedirs(self.directory, exist_ok=True)
        remove_stale(self.directory, lambda name: name.startswith(PART_PREFIX))
        self.max_bytes = max_bytes
        self.check_sha256 = check_sha256
        self.downloads = self.evictions = 0  # by this process
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._leases: OrderedDict[str, int] = OrderedDict()  # path -> locked descriptor, least recently used first
        self._fetching: dict[str, threading.Event] = {}  # local path -> set when its download ends

    def path(self, entry: dict[str, Any]) -> str:
        return os.path.join(self.directory, f"{str(entry['sha256'])[:16]}-{entry['name']}")

    def present(self, entry: dict[str, Any]) -> str | None:
        """The local copy of a manifest entry, if one of the listed size is already there."""
        path = self.path(entry)
        try:
            return path if os.path.getsize(path) == int(entry["bytes"]) else None
        except OSError:
            return None

    def get(self, location: str, entry: dict[str, Any], on_evict: Callable[[str], None]) -> str:
        """The local path of a shard, downloaded if needed, held by this process and now its most
        recently used; `on_evict(path)` is called for each of this process's copies given up to make
        room, before its lease goes."""
        self._after_fork()
        path = self.path(entry)
        for _ in range(TRIES):
            self._fetch(location, entry)
            if self._hold(path):
                break
        else:
            raise InfraError(
                f"{path}: deleted by another process each of the {TRIES} times it was fetched: is something "
                f"else cleaning {self.directory}?"
            )
        self._evict(path, on_evict)
        return path

    def touch(self, entry: dict[str, Any]) -> None:
        """Count a held copy as just used (a reader reading a shard it has open)."""
        path = self.path(entry)
        with self._lock:
            if path in self._leases:
                self._leases.move_to_end(path)

    def close(self) -> None:
        """Give up every lease, and delete the directory if it is a temporary one this process made
        (not in a forked child); a given one is kept."""
        self._after_fork()
        with self._lock:
            leases, self._leases = self._leases, OrderedDict()
        for fd in leases.values():
            os.close(fd)
        if self.downloads or self.evictions:
            log.info(
                "local shard copies in %s: %d downloaded, %d evicted", self.directory, self.downloads, self.evictions
            )
        if self._owner == os.getpid():
            shutil.rmtree(self.directory, ignore_errors=True)

    # ---------------------------------------------------------------- fetch and hold

    def _after_fork(self) -> None:
        """In a forked child (DataLoader workers), the parent's downloads and leases are not ours:
        the inherited descriptors are closed, which leaves the parent's locks in place."""
        if os.getpid() != self._pid:
            for fd in self._leases.values():
                os.close(fd)
            self._pid, self._lock, self._fetching, self._leases = os.getpid(), threading.Lock(), {}, OrderedDict()

    def _fetch(self, location: str, entry: dict[str, Any]) -> None:
        """Make the copy present: downloaded unless it is; one download per path at a time in this process."""
        path = self.path(entry)
        while self.present(entry) is None:
            with self._lock:
                running = self._fetching.get(path)
                if running is None:
                    done = self._fetching[path] = threading.Event()
            if running is not None:
                running.wait()
                continue  # there now, or that download failed: then this thread tries
            try:
                if self.present(entry) is None:  # another thread may have finished it just before
                    self._download(location, entry, path)
            finally:
                with self._lock:
                    del self._fetching[path]
                done.set()
            break

    def _download(self, location: str, entry: dict[str, Any], path: str) -> None:
        """Download into a locked temp folder, check it, lease it, then link it to `path` (unless
        another process linked its own copy first: that one is used)."""
        part_dir, part_lock = locked_temp_dir(self.directory, PART_PREFIX)
        part = os.path.join(part_dir, os.path.basename(path))
        try:
            storage.download_file(location, part)
            why = problem(part, entry, sha256=self.check_sha256)
            if why is not None:
                raise damaged(location, why)
            fd = os.open(part, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.link(part, path)
            except FileExistsError:
                os.close(fd)
                return
            self._add_lease(path, fd)
            with self._lock:
                self.downloads += 1
        finally:
            shutil.rmtree(part_dir, ignore_errors=True)
            os.close(part_lock)

    def _hold(self, path: str) -> bool:
        """Lease the copy at `path` (or check that the lease held is still on it); False when the
        copy was deleted meanwhile. Its mtime becomes now: the directory's LRU clock."""
        with self._lock:  # a lease's descriptor is used only under the lock, or once popped from _leases
            held = self._leases.get(path)
            renewed = held is not None and _same_file(held, path)
            if renewed:
                self._leases.move_to_end(path)
        if not renewed:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return False
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an evictor deletes it
            if not _same_file(fd, path):
                os.close(fd)
                return False
            self._add_lease(path, fd)
        with contextlib.suppress(OSError):  # a directory shared by several users: the copy may be another's
            os.utime(path)
        return True

    def _add_lease(self, path: str, fd: int) -> None:
        """Record `fd` as this process's lease on `path`, most recently used; a lease it replaces is closed."""
        with self._lock:
            old = self._leases.pop(path, None)
            self._leases[path] = fd
        if old is not None:
            os.close(old)

    # ---------------------------------------------------------------- evict

    def _evict(self, keep: str, on_evict: Callable[[str], None]) -> None:
        """Bring the directory under max_bytes: copies nobody holds first (oldest first), then this
        process's own least recently used leases, except `keep`."""
        if self.max_bytes is None:
            return
        copies = self._copies()
        total = sum(size for _, size in copies)
        with self._lock:
            mine = set(self._leases)
        for path, size in copies:
            if total <= self.max_bytes:
                return
            if path not in mine and self._delete_unheld(path):
                total -= size
        while total > self.max_bytes:
            with self._lock:
                victim = next((p for p in self._leases if p != keep), None)
                if victim is None:
                    return  # everything left is in use
                fd = self._leases.pop(victim)
            on_evict(victim)
            os.close(fd)
            size = next((s for p, s in copies if p == victim), 0)
            if self._delete_unheld(victim):  # else another process (or thread, again) holds it
                total -= size

    def _copies(self) -> list[tuple[str, int]]:
        """(path, bytes) of the copies in the directory, least recently used (oldest mtime) first."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if COPY_NAME.fullmatch(entry.name):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    found.append((stat.st_mtime_ns, entry.path, stat.st_size))
        return [(path, size) for _, path, size in sorted(found)]

    def _delete_unheld(self, path: str) -> bool:
        """Delete the copy at `path` if no process holds a lease on it; True if this call deleted it."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _same_file(fd, path):
                return False
            os.unlink(path)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        with self._lock:
            self.evictions += 1
        return True


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd` (not deleted, not another file since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)
