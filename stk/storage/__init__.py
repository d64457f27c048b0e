"""One small interface over local paths and s3:// URLs.

Everything is addressed by a *location*: a local path or `s3://bucket/key`. Callers never
branch on the scheme; the backend is picked here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import BinaryIO

from stk.storage.base import Backend, FileInfo, NotAFileError
from stk.storage.local import LocalBackend
from stk.storage.names import name_text, printable, text_name
from stk.storage.s3 import DEFAULT_RETRY_SECONDS, S3Backend, configure_s3

__all__ = [
    "DEFAULT_RETRY_SECONDS",
    "FileInfo",
    "NotAFileError",
    "check_writable",
    "configure_s3",
    "delete",
    "download_file",
    "exists",
    "is_s3",
    "join",
    "list_files",
    "name_text",
    "names",
    "open_read",
    "printable",
    "read_bytes",
    "stat",
    "text_name",
    "upload_file",
    "write_atomic",
]

_LOCAL = LocalBackend()
_S3 = S3Backend()


def is_s3(location: str) -> bool:
    return location.startswith("s3://")


def _backend(location: str) -> Backend:
    return _S3 if is_s3(location) else _LOCAL


def join(root: str, key: str) -> str:
    """The location of `key` under `root` (a directory or an s3:// prefix)."""
    if not root:
        return key
    return root.rstrip("/") + "/" + key.lstrip("/")


def list_files(root: str) -> Iterator[FileInfo]:
    """Every file under `root`, recursively, with keys relative to it ('/'-separated)."""
    return _backend(root).list_files(root)


def names(directory: str) -> Iterator[str]:
    """The names directly in `directory` (a directory or an s3:// prefix), as they come: one listing where asking
    whether each of many names exists would cost a request or a system call each."""
    return _backend(directory).names(directory)


def stat(location: str) -> FileInfo:
    return _backend(location).stat(location)


def exists(location: str) -> bool:
    return _backend(location).exists(location)


def open_read(location: str, size: int | None = None) -> BinaryIO:
    """A seekable binary reader; on S3 it fetches only the byte ranges that are read."""
    return _backend(location).open_read(location, size)


def read_bytes(location: str) -> bytes:
    return _backend(location).read_bytes(location)


def write_atomic(location: str, data: bytes) -> None:
    """Readers see the old content or the new, never a part (temp + fsync + rename; S3 PUT)."""
    _backend(location).write_atomic(location, data)


def delete(location: str) -> None:
    """Remove a file or object; one that is already gone is not an error."""
    _backend(location).delete(location)


def upload_file(local_path: str, location: str) -> None:
    """Put a copy of a local file at `location`, atomically; large files go to S3 in parts."""
    _backend(location).upload_file(local_path, location)


def download_file(location: str, local_path: str) -> None:
    """Copy `location` to a local file, atomically: `local_path` is complete or absent."""
    _backend(location).download_file(location, local_path)


def check_writable(root: str) -> None:
    """Fail now, before hours of work, when files cannot be written under `root`: on S3 a missing
    bucket, a wrong endpoint or credentials that may not write; on disk a missing permission or a
    read-only file system. A probe file is written and deleted."""
    if is_s3(root):
        next(iter(list_files(root)), None)  # a missing bucket is named as one (a PUT says "access denied")
    probe = join(root, f".stk-probe-{uuid.uuid4().hex}")
    write_atomic(probe, b"")
    delete(probe)
