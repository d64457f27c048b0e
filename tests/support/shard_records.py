"""Samples and a rank 0 for the shard format's tests: deterministic latents and text embeddings,
and what stk-cache's rank 0 does with each finished shard."""

from __future__ import annotations

import numpy as np

from stk import storage
from stk.shards import LatentRecord, Manifest, ShardInfo, TextRecord, shard_location
from stk.shards.manifest import shard_entry

__all__ = ["Rank0", "make_latent", "make_text"]


def make_latent(i: int, shape: tuple[int, int, int] = (4, 8, 8), dtype: str = "float16", logvar: bool = False):
    rng = np.random.default_rng(i)
    return LatentRecord(
        key=f"{i:040x}",
        text_key=f"{i % 7:064x}",
        mean=(rng.standard_normal(shape) * 4).astype(dtype),
        logvar=rng.standard_normal(shape).astype(dtype) if logvar else None,
        original_size=(300 + i, 400 + 2 * i),
        crop_top_left=(i % 5, i % 3),
        path=f"images/ü-{i}.jpg",
    )


def make_text(i: int, length: int) -> TextRecord:
    rng = np.random.default_rng(10_000 + i)
    prompt = rng.standard_normal((length, 32)).astype(np.float16)
    return TextRecord(
        key=f"{i:064x}",
        arrays={"prompt_embeds": prompt, "pooled_prompt_embeds": rng.standard_normal(24).astype(np.float32)},
        length=length,
    )


class Rank0:
    """What stk-cache's rank 0 does with finished shards: list them and save the manifest."""

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.manifest = Manifest.load(cache) or Manifest(config={"model": "tiny"}, scaling_factor=0.18215)
        self.infos: list[ShardInfo] = []

    def __call__(self, info: ShardInfo) -> None:
        assert storage.exists(shard_location(self.cache, info.name)), "listed before it was in place"
        self.infos.append(info)
        self.manifest.merge([shard_entry(info)])
        self.manifest.save(self.cache)
