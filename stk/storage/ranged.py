"""A seekable read-only file over an object store that serves byte ranges, each read one ranged request."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

__all__ = ["RangedReader"]


class RangedReader(io.RawIOBase):
    """A seekable read-only view of one object of `size` bytes; each read is one `read_range(start, end)` call."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int) -> None:
        self._read_range, self._size, self._pos = read_range, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def readall(self) -> bytes:
        """The rest of the object in one request (io's default would issue one per 8 KiB)."""
        data = self._read_range(self._pos, self._size)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size:
            return 0
        end = min(self._pos + len(buffer), self._size)
        data = self._read_range(self._pos, end)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)
