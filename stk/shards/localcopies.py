"""Whole shards of an s3:// cache on local disk, fetched on first use, least recently used out.

Random reads want a local file (one ranged GET per sample would cost milliseconds), so a reader
downloads a whole shard the first time it needs a sample from it. Files are named after the
shard's checksum as well as its name, so a directory kept between jobs, or shared by the ranks
of a node, is reused safely: a file of the listed size is taken as it is. Past `max_bytes`, the
least recently used copies this process fetched are deleted (never the one just asked for);
another process that still has one open keeps reading it (POSIX unlink), and one that opens it
later fetches it again. The limit is per process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
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
        self._sizes: OrderedDict[str, int] = OrderedDict()  # local path -> bytes, least recently used first

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
        """The local path of a shard, downloaded if needed; `on_evict(path)` is called for each
        copy deleted to make room, before it is deleted."""
        path = self.present(entry)
        if path is None:
            path = self.path(entry)
            storage.download_file(location, path)
            size = os.path.getsize(path)
            if size != int(entry["bytes"]):
                os.unlink(path)
                raise InputError(
                    f"{location}: {size} bytes, manifest.json lists {entry['bytes']}: "
                    "the shard changed after it was listed"
                )
        self._sizes[path] = int(entry["bytes"])
        self._sizes.move_to_end(path)
        self._evict(path, on_evict)
        return path

    def _evict(self, keep: str, on_evict: Callable[[str], None]) -> None:
        if self.max_bytes is None:
            return
        total = sum(self._sizes.values())
        for path in list(self._sizes):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            on_evict(path)
            total -= self._sizes.pop(path)
            with contextlib.suppress(FileNotFoundError):  # another process deleted it first
                os.unlink(path)

    def close(self) -> None:
        """Delete the directory if it is a temporary one this process made (not in a forked child);
        a given one is kept."""
        if self._owner == os.getpid():
            shutil.rmtree(self.directory, ignore_errors=True)
