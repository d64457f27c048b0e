"""What every storage backend provides."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

__all__ = ["Backend", "FileInfo", "NotAFileError"]


@dataclass(frozen=True)
class FileInfo:
    """A listed file. `error` is set when the entry exists but cannot be read, `error_kind` says
    how (broken_symlink, not_a_file, unreadable); a directory that cannot be listed is one entry
    whose key ends with "/"."""

    key: str
    location: str
    size: int
    mtime: float
    etag: str | None = None
    error: str | None = None
    error_kind: str | None = None


class NotAFileError(OSError):
    """A FIFO, socket, device or directory where a file is read: refused before any read, because
    reading a FIFO blocks forever and opening a device can act on it."""


class Backend(Protocol):
    def list_files(self, root: str) -> Iterator[FileInfo]: ...

    def names(self, directory: str) -> Iterator[str]: ...

    def stat(self, location: str) -> FileInfo: ...

    def exists(self, location: str) -> bool: ...

    def open_read(self, location: str, size: int | None) -> BinaryIO: ...

    def read_bytes(self, location: str) -> bytes: ...

    def read_range(self, location: str, start: int, end: int) -> bytes: ...

    def write_atomic(self, location: str, data: bytes) -> None: ...

    def delete(self, location: str) -> None: ...

    def upload_file(self, local_path: str, location: str) -> None: ...

    def download_file(self, location: str, local_path: str) -> None: ...
