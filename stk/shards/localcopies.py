"""Whole shards of an s3:// cache on local disk, fetched on first use, least recently used out.

Random reads want a local file (one ranged GET per sample would cost milliseconds), so a reader
downloads a whole shard the first time it needs a sample from it, or ahead of time (prefetch).
Files are named after the shard's checksum as well as its name, so a directory kept between jobs,
or shared by the ranks of a node, is reused safely: a file of the listed size is taken as it is.
Past `max_bytes`, the least recently used copies this process fetched are deleted (never the one
just asked for); another process that still has one open keeps reading it (POSIX unlink), and one
that opens it later fetches it again. The limit is per process, and counts finished copies only:
downloads in flight (at most one per thread) come on top of it.

Thread-safe. Two threads asking for the same shard share one download; downloads to the same
path from other processes are safe too (each writes a temp file and renames it). The lock here
guards the bookkeeping only: it is never held during a download nor while `on_evict` runs, since
`on_evict` takes the reader's lock and a reader may call in here while holding that lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from stk import storage
from stk.errors import InputError

__all__ = ["LocalCopies"]


class LocalCopies:
    def __init__(self, directory: str | None, max_bytes: int | None) -> None:
        self._owner = os.getpid() if directory is None else None  # a temp dir is this process's to delete
        self.directory = directory or tempfile.mkdtemp(prefix="stk-shards-")
        os.makedirs(self.directory, exist_ok=True)
        self.max_bytes = max_bytes
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # local path -> bytes, least recently used first
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
        """The local path of a shard, downloaded if needed, now the most recently used; `on_evict(path)`
        is called for each copy deleted to make room, before it is deleted."""
        if os.getpid() != self._pid:  # forked (DataLoader workers): the parent's downloads are not ours
            self._pid, self._lock, self._fetching = os.getpid(), threading.Lock(), {}
        path = self._fetch(location, entry)
        with self._lock:
            self._sizes[path] = int(entry["bytes"])
            self._sizes.move_to_end(path)
            victims = self._victims(keep=path)
        for victim in victims:
            on_evict(victim)
        with self._lock:
            for victim in victims:
                # asked for again meanwhile (listed again, or being fetched): in use, keep it
                if victim not in self._sizes and victim not in self._fetching:
                    with contextlib.suppress(FileNotFoundError):  # another process deleted it first
                        os.unlink(victim)
        return path

    def touch(self, entry: dict[str, Any]) -> None:
        """Count a listed copy as just used (a reader reading a shard it has open)."""
        path = self.path(entry)
        with self._lock:
            if path in self._sizes:
                self._sizes.move_to_end(path)

    def _fetch(self, location: str, entry: dict[str, Any]) -> str:
        """The local copy, downloaded unless present; one download per path at a time in this process."""
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
        return path

    @staticmethod
    def _download(location: str, entry: dict[str, Any], path: str) -> None:
        storage.download_file(location, path)
        size = os.path.getsize(path)
        if size != int(entry["bytes"]):
            os.unlink(path)
            raise InputError(
                f"{location}: {size} bytes, manifest.json lists {entry['bytes']}: the shard changed after it was listed"
            )

    def _victims(self, keep: str) -> list[str]:
        """Unlist least recently used copies (not `keep`) until the rest fit; called with the lock held."""
        if self.max_bytes is None:
            return []
        total = sum(self._sizes.values())
        victims = []
        for path in list(self._sizes):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            total -= self._sizes.pop(path)
            victims.append(path)
        return victims

    def close(self) -> None:
        """Delete the directory if it is a temporary one this process made (not in a forked child);
        a given one is kept."""
        if self._owner == os.getpid():
            shutil.rmtree(self.directory, ignore_errors=True)
