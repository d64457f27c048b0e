"""A shard's staging file (`<run>-r<rank>-<seq>.h5.tmp`) from creation to removal.

Two facts shape it. HDF5 cannot close a file once one of its writes has failed: the close
flushes again, fails again, and the process crashes (h5py issue 914; measured with HDF5 2.0 on
a full tmpfs: exit 139 instead of an error). So HDF5 writes through `StagedFile`, which keeps
the first failure instead of raising it into HDF5 and skips later writes; the shard writer
raises it after the record and abandons the shard, and the HDF5 file closes cleanly.

And a staging file is owned while its writer lives: `StagedFile` holds an exclusive flock on
it until it is closed, which the kernel releases when the process dies however it dies. A later
run removes `.h5.tmp` files nobody holds (`remove_stale`), never one a live run or rank is
writing, even when several runs share one staging directory. Downloads of shard copies
(stk/shards/localcopies.py) follow the same rule with a locked temp folder (`locked_temp_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from stk.log import get_logger

__all__ = ["STAGED_SUFFIX", "StagedFile", "locked_temp_dir", "remove_stale"]

STAGED_SUFFIX = ".h5.tmp"

log = get_logger("shards")


def _locked_if_still_there(fd: int, path: str) -> bool:
    """Lock the new file or folder open as `fd`. A stale-file cleanup may have locked and removed it
    between its creation and the lock: then `path` no longer names it, `fd` is closed, and the
    caller creates it again."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    with contextlib.suppress(FileNotFoundError):
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            return True
    os.close(fd)
    return False


def _create_locked(path: str) -> int:
    """A new file at `path`, opened read-write and locked."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        if _locked_if_still_there(fd, path):
            return fd


class StagedFile(io.RawIOBase):
    """The file object HDF5 writes a shard through (h5py's file-object driver). `error` holds
    the first failed write (an OSError naming the path); once set, writes are skipped."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.error: OSError | None = None
        self._file = io.FileIO(_create_locked(path), "r+")

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: Any) -> int:
        return self._file.readinto(buffer) or 0

    def write(self, data: Any) -> int:
        """Everything or nothing: h5py does not look at the count (a short write would be lost)."""
        view = memoryview(data).cast("B")
        done = 0
        if self.error is None:
            try:
                while done < len(view):
                    done += self._file.write(view[done:]) or 0
            except OSError as exc:
                self._fail(exc)
        self._file.seek(len(view) - done, os.SEEK_CUR)
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._file.truncate(size)
            except OSError as exc:
                self._fail(exc)
        return self.tell() if size is None else size

    def sync(self) -> None:
        """fsync, so that a shard listed later survives a crash of the node."""
        if self.error is None:
            try:
                os.fsync(self._file.fileno())
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        """Close the file and give up its lock (a rename or upload should come first)."""
        if not self.closed:
            self._file.close()
        super().close()

    def discard(self) -> None:
        """Close and remove the file: an abandoned shard frees its space at once."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _fail(self, exc: OSError) -> None:
        self.error = OSError(exc.errno, exc.strerror, self.path)


def locked_temp_dir(parent: str, prefix: str) -> tuple[str, int]:
    """A new folder in `parent` and a descriptor holding an exclusive flock on it: its contents
    are this process's until the descriptor closes (`remove_stale` with `prefix` spares it)."""
    while True:
        path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        if _locked_if_still_there(fd, path):
            return path, fd


def _is_staged_shard(name: str) -> bool:
    return name.endswith(STAGED_SUFFIX)


def remove_stale(work_dir: str, is_staged: Callable[[str], bool] = _is_staged_shard) -> None:
    """Remove the staging files or folders in `work_dir` (those `is_staged` names) that no live
    writer holds: those of killed or failed runs, which would otherwise fill the disk one shard
    per rank per failure."""
    for name in sorted(os.listdir(work_dir)):
        if not is_staged(name):
            continue
        path = os.path.join(work_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # removed meanwhile by another rank's cleanup
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run or rank is writing it
        else:
            with contextlib.suppress(FileNotFoundError):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                log.info("removed %s: left by an earlier run that did not finish", path)
        finally:
            os.close(fd)
