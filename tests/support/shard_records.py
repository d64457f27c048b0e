"""Samples and a rank 0 for the shard format's tests: deterministic latents and text embeddings,
and what stk-cache's rank 0 does with each finished shard."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stk import storage
from stk.shards import LatentRecord, Manifest, ShardInfo, ShardWriter, TextRecord, shard_location
from stk.shards.manifest import shard_entry

__all__ = [
    "SHAPES",
    "Rank0",
    "assert_same_latent",
    "assert_same_text",
    "make_latent",
    "make_text",
    "staged",
    "write",
]


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


SHAPES = [(4, 8, 8), (4, 8, 16), (4, 16, 8)]


def write(
    cache: str,
    latents: list[LatentRecord],
    texts: list[TextRecord] = (),  # type: ignore[assignment]
    prefix: str = "r0",
    shard_size: int = 4000,
    work_dir: str | None = None,
) -> Rank0:
    rank0 = Rank0(cache)
    writer = ShardWriter(cache, work_dir or storage.join(cache, "shards"), prefix, shard_size, rank0)
    for text in texts:
        writer.add_text(text)
    for sample in latents:
        writer.add_latent(sample)
    writer.close()
    return rank0


def assert_same_latent(got: LatentRecord, want: LatentRecord) -> None:
    assert got.mean.dtype == want.mean.dtype and got.mean.shape == want.mean.shape
    assert got.mean.tobytes() == want.mean.tobytes()
    if want.logvar is None:
        assert got.logvar is None
    else:
        assert got.logvar is not None and got.logvar.dtype == want.logvar.dtype
        assert got.logvar.tobytes() == want.logvar.tobytes()
    assert (got.key, got.text_key, got.path) == (want.key, want.text_key, want.path)
    assert (got.original_size, got.crop_top_left) == (want.original_size, want.crop_top_left)


def assert_same_text(got: TextRecord, want: TextRecord) -> None:
    assert (got.key, got.length, sorted(got.arrays)) == (want.key, want.length, sorted(want.arrays))
    for name, array in want.arrays.items():
        assert got.arrays[name].dtype == array.dtype and got.arrays[name].shape == array.shape
        assert got.arrays[name].tobytes() == array.tobytes()


def staged(work: Path) -> list[Path]:
    return sorted(work.rglob("*.h5.tmp"))
