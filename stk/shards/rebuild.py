"""A cache's manifest rebuilt from its shards, for `stk-cache verify --repair` when manifest.json
cannot be read: no finished shard is lost to a damaged manifest.

Each shard carries the manifest's header (what made the cache; layout.py) and its keys, shapes and
dtypes. Without the manifest's sha256 a shard is checked by reading it whole: every dataset, every
record's frame decompressed to its shape. A byte changed inside a frame that still decompresses
cannot be told this way (zstd frames carry no checksum); the sha256 taken now guards it from here on.

The shards made with the header most of them carry are listed (a shard whose header names another
config was made before a `--force`); validation prompts and other header fields come from the
newest of them. Damaged shards and those of another config are deleted, as `--repair` deletes the
damaged shards of a readable manifest, so that rerunning stk-cache encodes their records again.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from stk import storage
from stk.errors import CacheIncomplete
from stk.shards.layout import HEADER, SHARDS_DIR, TEXT, decompress, file_sha256, open_h5, shard_keys, shard_location
from stk.shards.manifest import MANIFEST, Manifest

__all__ = ["Rebuilt", "rebuild_manifest"]


@dataclass
class Rebuilt:
    manifest: Manifest
    dropped: list[str]  # "name: why", deleted


@dataclass
class _Shard:
    entry: dict[str, Any]
    header: dict[str, Any]
    mtime: float


def _read_whole(file: h5py.File) -> tuple[int, int]:
    """Read every dataset of an open shard and decompress every record; its latent and text counts.
    Raises (OSError, ValueError, KeyError) at the first thing that does not read back."""
    latents, texts = shard_keys(file)
    for path, keys in latents.items():
        group = file[path]
        shape = tuple(int(n) for n in path.rsplit("/", 1)[1].split("x"))
        dtype = np.dtype(str(group.attrs["dtype"]))
        for name in ("text_key", "original_size", "crop_top_left", "path"):
            if len(group[name][()]) != len(keys):
                raise ValueError(f"{path}/{name} does not have one row per key")
        for name in ("mean", "logvar") if "logvar" in group else ("mean",):
            dataset = group[name]
            if dataset.shape[0] != len(keys):
                raise ValueError(f"{path}/{name} does not have one row per key")
            for row in range(len(keys)):
                _, frame = dataset.id.read_direct_chunk((row,) + (0,) * len(shape))
                decompress(frame, dtype, shape)
    if texts:
        group = file[TEXT]
        if len(group["length"][()]) != len(texts):
            raise ValueError(f"{TEXT}/length does not have one row per key")
        for name in (str(n) for n in group.attrs["arrays"]):
            sub = group[name]
            data, ends, shapes = sub["data"][()], sub["end"][()], sub["shape"][()]
            if len(ends) != len(texts) or len(shapes) != len(texts):
                raise ValueError(f"{TEXT}/{name} does not have one row per key")
            dtype = np.dtype(str(sub.attrs["dtype"]))
            start = 0
            for end, shape in zip(ends.tolist(), shapes.tolist(), strict=True):
                decompress(data[start:end].data, dtype, tuple(shape))
                start = end
    return sum(len(k) for k in latents.values()), len(texts)


def _inspect(path: str, name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A local shard file's manifest entry and the header it carries (None: an older stk's shard)."""
    with open_h5(path, "r") as file:
        latents, texts = _read_whole(file)
        raw = file.attrs.get(HEADER)
    header = json.loads(raw) if raw is not None else None
    entry = {
        "name": name,
        "latents": latents,
        "texts": texts,
        "bytes": os.path.getsize(path),
        "sha256": file_sha256(path),
    }
    return entry, header


def _shards(cache: str, dropped: list[str]) -> list[_Shard]:
    """Every intact shard of the cache with its header; the rest go to `dropped`."""
    found: list[_Shard] = []
    directory = storage.join(cache, SHARDS_DIR)
    if not storage.is_s3(cache) and not os.path.isdir(directory):
        return found
    with tempfile.TemporaryDirectory(prefix="stk-rebuild-") as scratch:
        for info in sorted(storage.list_files(directory), key=lambda i: i.key):
            if "/" in info.key or not info.key.endswith(".h5"):
                continue
            path = info.location
            if storage.is_s3(cache):
                path = os.path.join(scratch, info.key)
                storage.download_file(info.location, path)
            try:
                entry, header = _inspect(path, info.key)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                dropped.append(f"{info.key}: unreadable: {exc}")
                continue
            finally:
                if path != info.location and os.path.exists(path):
                    os.unlink(path)
            if not isinstance(header, dict) or not isinstance(header.get("config"), dict):
                dropped.append(f"{info.key}: carries no manifest header (written by an older stk)")
                continue
            found.append(_Shard(entry, header, info.mtime))
    return found


def rebuild_manifest(cache: str) -> Rebuilt:
    """Write CACHE/manifest.json anew from the intact shards and delete the others. Raises
    CacheIncomplete when no intact shard says what made the cache."""
    dropped: list[str] = []
    shards = _shards(cache, dropped)
    configs = Counter(json.dumps(s.header["config"], sort_keys=True) for s in shards)
    if not configs:
        raise CacheIncomplete(
            f"{storage.join(cache, MANIFEST)} cannot be rebuilt: no intact shard says what made the cache "
            f"({len(dropped)} unreadable or written by an older stk); rerun stk-cache with --force to encode it again"
        )
    chosen = configs.most_common(1)[0][0]
    kept = [s for s in shards if json.dumps(s.header["config"], sort_keys=True) == chosen]
    dropped += [f"{s.entry['name']}: made with another config" for s in shards if s not in kept]
    newest = max(kept, key=lambda s: (s.mtime, s.entry["name"]))
    manifest = Manifest.from_header(newest.header, [s.entry for s in kept], storage.join(cache, SHARDS_DIR))
    manifest.save(cache)
    for why in dropped:
        storage.delete(shard_location(cache, why.split(":", 1)[0]))
    return Rebuilt(manifest, dropped)
