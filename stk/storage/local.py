"""Local (or NFS-mounted) files."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

from stk.errors import InputError
from stk.storage.base import FileInfo
from stk.storage.failures import storage_errors

__all__ = ["LocalBackend", "fsync_dir"]


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class LocalBackend:
    def list_files(self, root: str) -> Iterator[FileInfo]:
        if not os.path.isdir(root):
            raise InputError(f"{root}: no such directory")
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            try:
                entries = list(os.scandir(os.path.join(root, rel_dir)))
            except OSError as exc:
                raise InputError(f"cannot list {os.path.join(root, rel_dir)}: {exc.strerror}") from exc
            for entry in entries:
                key = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(key)
                    continue
                try:
                    st = entry.stat()  # follows symlinks: a link to a file lists as that file
                except OSError as exc:
                    reason = "broken symlink" if entry.is_symlink() else f"cannot stat: {exc.strerror}"
                    yield FileInfo(key, entry.path, 0, 0.0, error=reason)
                    continue
                if entry.is_dir():  # a symlink to a directory: not followed, avoids cycles
                    continue
                yield FileInfo(key, entry.path, st.st_size, st.st_mtime_ns / 1e9)

    def stat(self, location: str) -> FileInfo:
        st = os.stat(location)
        return FileInfo(location, location, st.st_size, st.st_mtime_ns / 1e9)

    def exists(self, location: str) -> bool:
        return os.path.exists(location)

    def open_read(self, location: str, size: int | None) -> BinaryIO:
        return open(location, "rb")

    def read_bytes(self, location: str) -> bytes:
        with open(location, "rb") as f:
            return f.read()

    def read_range(self, location: str, start: int, end: int) -> bytes:
        with open(location, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def write_atomic(self, location: str, data: bytes) -> None:
        _write_atomic(location, lambda out: out.write(data))

    def delete(self, location: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(location)

    def upload_file(self, local_path: str, location: str) -> None:
        _copy_atomic(local_path, location)

    def download_file(self, location: str, local_path: str) -> None:
        _copy_atomic(location, local_path)


def _copy_atomic(source: str, destination: str) -> None:
    with open(source, "rb") as src:
        _write_atomic(destination, lambda out: shutil.copyfileobj(src, out, 8 * 1024 * 1024))


def _write_atomic(destination: str, fill: Callable[[BinaryIO], object]) -> None:
    """Fill a temp file beside `destination`, fsync, rename: readers never see a partial file.
    A disk that fails names `destination` (not the temp file) in its one-line error."""
    directory = os.path.dirname(destination) or "."
    with storage_errors(destination):
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
            with os.fdopen(fd, "wb") as out:
                fill(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, destination)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(directory)
