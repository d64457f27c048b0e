"""stk.shards.manifest: only closed shards are listed, a merge lists each shard once, the round trip and its
refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.shard_records import Rank0, make_latent

from stk import storage
from stk.errors import ExitCode, InputError
from stk.shards import (
    CacheReader,
    Manifest,
    ShardInfo,
    ShardWriter,
    shard_location,
)
from stk.shards.manifest import ManifestDamaged, shard_entry

# --- listing and crashes ------------------------------------------------------------------------


def test_manifest_lists_only_closed_shards(cache: str) -> None:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 3000, rank0)
    for i in range(20):
        writer.add_latent(make_latent(i))
        listed = {s["name"] for s in Manifest.load(cache).shards} if rank0.infos else set()  # type: ignore[union-attr]
        on_disk = set(os.listdir(storage.join(cache, "shards")))
        assert listed == {n for n in on_disk if n.endswith(".h5")}
        assert len([n for n in on_disk if n.endswith(".h5.tmp")]) <= 1
    assert rank0.infos
    writer.close()
    manifest = Manifest.load(cache)
    assert manifest is not None and manifest.scaling_factor == 0.18215
    assert [s["name"] for s in manifest.shards] == sorted(os.listdir(storage.join(cache, "shards")))
    for entry, info in zip(manifest.shards, rank0.infos, strict=True):
        assert entry == {k: getattr(info, k) for k in ("name", "latents", "texts", "bytes", "sha256")}
        assert info.bytes == os.path.getsize(shard_location(cache, info.name))


def test_merge_lists_each_shard_once() -> None:
    first, second = ShardInfo("r0-00000.h5", 3, 1, 100, "ab" * 32), ShardInfo("r1-00000.h5", 2, 0, 80, "cd" * 32)
    manifest = Manifest(config={})
    manifest.merge([shard_entry(first)])
    manifest.merge([shard_entry(first), shard_entry(second), shard_entry(second)])
    assert manifest.shards == [
        {"name": "r0-00000.h5", "latents": 3, "texts": 1, "bytes": 100, "sha256": "ab" * 32},
        {"name": "r1-00000.h5", "latents": 2, "texts": 0, "bytes": 80, "sha256": "cd" * 32},
    ]


def test_manifest_round_trip_and_refusals(cache: str) -> None:
    assert Manifest.load(cache) is None
    manifest = Manifest(config={"family": "sdxl"}, scaling_factor=0.13025, extra={"created_by": "test"})
    manifest.merge([shard_entry(ShardInfo("r0-00000.h5", 3, 1, 100, "ab" * 32))])
    manifest.save(cache)
    assert Manifest.load(cache) == manifest
    manifest_bytes = storage.read_bytes(storage.join(cache, "manifest.json"))
    storage.write_atomic(storage.join(cache, "manifest.json"), b'{"version": 99, "config": {}, "shards": []}')
    with pytest.raises(InputError, match="version 99"):
        Manifest.load(cache)
    storage.write_atomic(storage.join(cache, "manifest.json"), b"[1, 2]")
    with pytest.raises(ManifestDamaged, match="not a cache manifest") as damaged:
        Manifest.load(cache)
    assert damaged.value.exit_code == ExitCode.INCOMPLETE and f"stk-cache verify {cache} --repair" in str(damaged.value)
    storage.write_atomic(storage.join(cache, "manifest.json"), manifest_bytes[: len(manifest_bytes) // 2])
    with pytest.raises(ManifestDamaged, match="is damaged \\(not JSON"):
        Manifest.load(cache)
    with pytest.raises(InputError, match=r"no manifest\.json"):
        CacheReader(str(Path(cache) / "elsewhere"))
