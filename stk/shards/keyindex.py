"""A cache's keys as sorted columns: key -> (group, row) in about 50 bytes a key, no Python object per key.

CacheReader holds one for latents and one for text embeddings. Keys are added shard by shard, group by group;
a key added twice keeps its first place (the first shard in manifest order serves it)."""

from __future__ import annotations

import numpy as np

__all__ = ["KeyIndex"]


class KeyIndex:
    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, int]] = []
        self.keys = np.zeros(0, "S1")  # sorted, distinct (bytes)
        self.group = np.zeros(0, np.int32)
        self.row = np.zeros(0, np.int32)

    def add(self, keys: np.ndarray, group: int) -> None:
        """A group's keys (bytes, in row order); trailing NULs of a wider array are not part of a key."""
        width = int(np.char.str_len(keys).max()) if len(keys) else 1
        self._parts.append((keys.astype(f"S{width}"), group))

    def freeze(self) -> None:
        """Sort what was added (a stable sort: the first of equal keys stays first) and drop repeated keys."""
        if not self._parts:
            return
        keys = np.concatenate([keys for keys, _ in self._parts])
        group = np.concatenate([np.full(len(keys), g, np.int32) for keys, g in self._parts])
        row = np.concatenate([np.arange(len(keys), dtype=np.int32) for keys, _ in self._parts])
        self._parts = []
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        first = np.r_[True, keys[1:] != keys[:-1]] if len(keys) else np.zeros(0, bool)
        self.keys, self.group, self.row = keys[first], group[order][first], row[order][first]
        self.keys.flags.writeable = False

    def __len__(self) -> int:
        return len(self.keys)

    def position(self, key: str) -> int:
        """Where `key` is in `keys`, or -1."""
        try:
            raw = key.encode("ascii")
        except UnicodeEncodeError:
            return -1
        if not raw or len(raw) > self.keys.itemsize:
            return -1
        at = int(np.searchsorted(self.keys, raw))
        return at if at < len(self.keys) and self.keys[at] == raw else -1

    def find(self, key: str) -> tuple[int, int] | None:
        """The key's (group, row), or None."""
        at = self.position(key)
        return None if at < 0 else (int(self.group[at]), int(self.row[at]))

    def strings(self) -> list[str]:
        return [k.decode() for k in self.keys.tolist()]
