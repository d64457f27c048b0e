"""stk.shards.rebuild: a damaged manifest rebuilt from the intact shards, and one that cannot be."""

from __future__ import annotations

import os

import pytest
from support.shard_records import Rank0, assert_same_latent, assert_same_text, make_latent, make_text, write

from stk import storage
from stk.errors import CacheIncomplete
from stk.shards import (
    CacheReader,
    Manifest,
    ShardWriter,
    shard_location,
    verify,
)
from stk.shards.rebuild import rebuild_manifest


def test_a_damaged_manifest_is_rebuilt_from_the_intact_shards(cache: str) -> None:
    """Each shard carries the manifest's header: a truncated manifest.json is rebuilt from the shards that
    read back whole, listing every one of their samples; a truncated shard and an older stk's shard (no
    header) are dropped and deleted."""
    header = Manifest(
        config={"family": "sd", "model": {"vae": "v1"}},
        scaling_factor=0.18215,
        validation_prompts=["a cat"],
        extra={"created_by": "test"},
    ).header()
    latents = [make_latent(i) for i in range(20)]
    texts = [make_text(i, 3 + i) for i in range(4)]
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, storage.join(cache, "shards"), "r0", 3000, rank0, header)
    for text in texts:
        writer.add_text(text)
    for sample in latents:
        writer.add_latent(sample)
    writer.close()
    legacy = write(cache, [make_latent(100)], prefix="old")  # an older stk's shard: no header in it
    cut = rank0.infos[-1]
    with open(shard_location(cache, cut.name), "r+b") as f:
        f.truncate(cut.bytes // 2)
    manifest_path = storage.join(cache, "manifest.json")
    whole = storage.read_bytes(manifest_path)
    storage.write_atomic(manifest_path, whole[: len(whole) // 3])

    rebuilt = rebuild_manifest(cache)
    kept = {info.name for info in rank0.infos[:-1]}
    assert {s["name"] for s in rebuilt.manifest.shards} == kept
    assert sorted(why.split(":", 1)[0] for why in rebuilt.dropped) == sorted([cut.name, legacy.infos[0].name])
    assert not os.path.exists(shard_location(cache, cut.name))
    loaded = Manifest.load(cache)
    assert loaded is not None and loaded.header() == header and loaded.shards == rebuilt.manifest.shards
    assert verify(cache).ok
    with CacheReader(cache) as reader:
        for sample in latents:
            if sample.key not in cut.latent_keys:
                assert_same_latent(reader.latent(sample.key), sample)
        for text in texts:
            if text.key not in cut.text_keys:
                assert_same_text(reader.text(text.key), text)


def test_a_manifest_without_a_described_shard_cannot_be_rebuilt(cache: str) -> None:
    write(cache, [make_latent(i) for i in range(3)])  # no header in the shards
    storage.write_atomic(storage.join(cache, "manifest.json"), b"{")
    with pytest.raises(CacheIncomplete, match=r"cannot be rebuilt.*--force"):
        rebuild_manifest(cache)
