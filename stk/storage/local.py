"""Local (or NFS-mounted) files."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

from stk.errors import InputError
from stk.storage.base import FileInfo, NotAFileError
from stk.storage.failures import storage_errors
from stk.storage.modes import honour_umask

__all__ = ["LocalBackend", "fsync_dir"]


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend:
    def list_files(self, root: str) -> Iterator[FileInfo]:
        """A subdirectory that cannot be listed is one error entry; the rest of the tree is listed."""
        yield from self.walk(root, [""])

    def walk(self, root: str, rel_dirs: list[str]) -> Iterator[FileInfo]:
        """Every file in the subtrees `rel_dirs` of `root` (keys relative to `root`)."""
        stack = list(rel_dirs)
        while stack:
            files, subdirs = self.level(root, stack.pop())
            yield from files
            stack.extend(subdirs)

    def level(self, root: str, rel_dir: str) -> tuple[list[FileInfo], list[str]]:
        """The files directly in `rel_dir` under `root`, and its subdirectories (keys relative to `root`)."""
        if not rel_dir and not os.path.isdir(root):
            raise InputError(f"{root}: no such directory")
        directory = os.path.join(root, rel_dir)
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            if not rel_dir:
                raise InputError(f"cannot list {root}: {exc.strerror}") from exc
            reason = f"cannot list directory: {exc.strerror}"
            return [FileInfo(f"{rel_dir}/", directory, 0, 0.0, error=reason, error_kind="unreadable")], []
        files: list[FileInfo] = []
        subdirs: list[str] = []
        for entry in entries:
            key = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(key)
                continue
            try:
                st = entry.stat()  # follows symlinks: a link to a file lists as that file
            except OSError as exc:
                kind = "broken_symlink" if entry.is_symlink() else "unreadable"
                reason = "broken symlink" if kind == "broken_symlink" else f"cannot stat: {exc.strerror}"
                files.append(FileInfo(key, entry.path, 0, 0.0, error=reason, error_kind=kind))
                continue
            if not stat.S_ISDIR(st.st_mode):  # a symlink to a directory: not followed, avoids cycles
                files.append(_info(key, entry.path, st))
        return files, subdirs

    def names(self, directory: str) -> Iterator[str]:
        """What exists() finds in `directory`: its entries, a symlink only where it leads somewhere."""
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.is_symlink() or os.path.exists(entry.path):
                    yield entry.name

    def stat(self, location: str) -> FileInfo:
        return _info(location, location, os.stat(location))

    def exists(self, location: str) -> bool:
        return os.path.exists(location)

    def open_read(self, location: str, size: int | None) -> BinaryIO:
        return _open_file(location)

    def read_bytes(self, location: str) -> bytes:
        with _open_file(location) as f:
            return f.read()

    def read_range(self, location: str, start: int, end: int) -> bytes:
        with _open_file(location) as f:
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


def _what_is(mode: int) -> str | None:
    """What a non-regular file is, for people; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _info(key: str, location: str, st: os.stat_result) -> FileInfo:
    """A listed or stat'ed file; anything but a regular file is an error entry (not_a_file)."""
    what = _what_is(st.st_mode)
    if what is None:
        return FileInfo(key, location, st.st_size, st.st_mtime_ns / 1e9)
    reason = f"is {what}, not a regular file"
    return FileInfo(key, location, 0, st.st_mtime_ns / 1e9, error=reason, error_kind="not_a_file")


def _open_file(location: str) -> BinaryIO:
    """Open a regular file for reading, refusing anything else before it is opened (stat) and again
    once open (fstat: replaced in between). O_NONBLOCK keeps even that race from hanging on a FIFO."""
    _require_file(os.stat(location).st_mode, location)
    fd = os.open(location, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _require_file(os.fstat(fd).st_mode, location)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _require_file(mode: int, location: str) -> None:
    what = _what_is(mode)
    if what is not None:
        raise NotAFileError(f"{location}: is {what}, not a regular file")


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
            honour_umask(fd)  # mkstemp makes 0600
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
