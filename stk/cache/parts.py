"""Crash-safe shard records: each rank lists the shards it has finished in its own small file,
`CACHE/manifest.d/<writer>.json`, rewritten atomically after every shard. A rerun after a kill
folds these into manifest.json before planning, so finished shards are kept and their keys
skipped; a shard that was never recorded is simply not listed and its samples are redone."""

from __future__ import annotations

import json
from typing import Any

from stk import storage
from stk.log import get_logger
from stk.shards import ShardInfo
from stk.shards.manifest import shard_entry

__all__ = ["PartRecorder", "read_parts", "remove_parts"]

PARTS_DIR = "manifest.d"

log = get_logger("cache")


class PartRecorder:
    def __init__(self, cache: str, writer_name: str) -> None:
        self.location = storage.join(cache, f"{PARTS_DIR}/{writer_name}.json")
        self.finished: list[ShardInfo] = []

    def __call__(self, info: ShardInfo) -> None:
        self.finished.append(info)
        entries = [shard_entry(i) for i in self.finished]
        storage.write_atomic(self.location, json.dumps(entries, indent=1).encode())


def read_parts(cache: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Shard entries from every part file, and the part files' locations."""
    root = storage.join(cache, PARTS_DIR)
    if not storage.is_s3(cache) and not storage.exists(root):
        return [], []
    entries: list[dict[str, Any]] = []
    locations: list[str] = []
    for info in sorted(storage.list_files(root), key=lambda i: i.key):
        if info.key.endswith(".json") and "/" not in info.key and not info.key.startswith(".tmp-"):
            locations.append(info.location)
            try:
                entries.extend(json.loads(storage.read_bytes(info.location)))
            except ValueError as exc:  # written atomically, so only damage does this: its shards are redone
                log.warning("%s is damaged (%s): the shards it lists are encoded again", info.location, exc)
    return entries, locations


def remove_parts(locations: list[str]) -> None:
    for location in locations:
        storage.delete(location)
