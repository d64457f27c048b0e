"""The layouts bench/cache.py compares, each written and read back: stk's shards, a gzipped torch.save file per
sample, raw bytes (the disk's limit) and zstd alone (the decompression floor), on generated latents and texts."""

from __future__ import annotations

import gzip
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard

from stk.shards import CacheReader, LatentRecord, Manifest, ShardInfo, ShardWriter, TextRecord
from stk.shards.layout import ZSTD_LEVEL, compress, decompress
from stk.shards.manifest import shard_entry

LATENT_SHAPE = (4, 64, 64)
TOKENS, WIDTH, POOLED = 77, 768, 1280
LENGTHS = (8, 16, 24, 40, 77)
SHARD_SIZE = 256 * 1024 * 1024


@dataclass
class Samples:
    keys: list[str]
    text_keys: list[str]
    latents: np.ndarray  # (N, 4, 64, 64) float16
    prompts: np.ndarray  # (N, 77, 768) float16
    pooled: np.ndarray  # (N, 1280) float16
    lengths: list[int]

    def latent(self, i: int) -> LatentRecord:
        return LatentRecord(self.keys[i], self.text_keys[i], self.latents[i], None, (768, 1024), (0, 64), f"{i}.jpg")

    def text(self, i: int) -> TextRecord:
        arrays = {"prompt_embeds": self.prompts[i], "pooled_prompt_embeds": self.pooled[i]}
        return TextRecord(self.text_keys[i], arrays, self.lengths[i])


def make_samples(count: int, seed: int) -> Samples:
    rng = np.random.default_rng(seed)
    latents = np.empty((count, *LATENT_SHAPE), np.float16)
    for start in range(0, count, 1000):
        n = min(1000, count - start)
        low = torch.from_numpy(rng.standard_normal((n, 4, 8, 8), dtype=np.float32))
        field = torch.nn.functional.interpolate(low, size=LATENT_SHAPE[1:], mode="bilinear", align_corners=False)
        latents[start : start + n] = field.numpy() * 3 + rng.standard_normal((n, *LATENT_SHAPE)) * 0.7
    prompts = np.empty((count, TOKENS, WIDTH), np.float16)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(count)]
    for i, length in enumerate(lengths):
        prompts[i, :length] = rng.standard_normal((length, WIDTH), dtype=np.float32)
        prompts[i, length:] = rng.standard_normal(WIDTH, dtype=np.float32)
    pooled = rng.standard_normal((count, POOLED), dtype=np.float32).astype(np.float16)
    keys = [hashlib.sha256(f"latent {i}".encode()).hexdigest() for i in range(count)]
    text_keys = [hashlib.sha256(f"text {i}".encode()).hexdigest() for i in range(count)]
    return Samples(keys, text_keys, latents, prompts, pooled, lengths)


def write_stk(samples: Samples, cache: Path) -> float:
    manifest = Manifest(config={"bench": True})

    def done(info: ShardInfo) -> None:
        manifest.merge([shard_entry(info)])
        manifest.save(str(cache))

    started = time.perf_counter()
    with ShardWriter(str(cache), str(cache / "shards"), "r0", SHARD_SIZE, done) as writer:
        for i in range(len(samples.keys)):
            writer.add_text(samples.text(i))
            writer.add_latent(samples.latent(i))
    return time.perf_counter() - started


def read_stk(cache: Path, order: list[str]) -> float:
    with CacheReader(str(cache)) as reader:
        started = time.perf_counter()
        for key in order:
            latent = reader.latent(key)
            reader.text(latent.text_key)
        return time.perf_counter() - started


def check_stk(cache: Path, samples: Samples) -> int:
    """Samples that do not come back bit for bit."""
    wrong = 0
    with CacheReader(str(cache)) as reader:
        for i, key in enumerate(samples.keys):
            latent = reader.latent(key)
            text = reader.text(latent.text_key)
            same = latent.mean.tobytes() == samples.latents[i].tobytes() and text.length == samples.lengths[i]
            same = same and text.arrays["prompt_embeds"].tobytes() == samples.prompts[i].tobytes()
            wrong += not (same and text.arrays["pooled_prompt_embeds"].tobytes() == samples.pooled[i].tobytes())
    return wrong


def _torch_gzip_save(obj: object, path: Path) -> None:
    with gzip.open(path, "wb", compresslevel=9) as f:
        torch.save(obj, f)


def write_torch_gzip(samples: Samples, root: Path) -> float:
    (root / "latents").mkdir(parents=True)
    (root / "text").mkdir()
    started = time.perf_counter()
    for i, key in enumerate(samples.keys):
        latent = {"mean": torch.from_numpy(samples.latents[i]), "original_size": (768, 1024), "crop": (0, 64)}
        _torch_gzip_save(latent, root / "latents" / f"{key}.pt.gz")
        text = {
            "prompt_embeds": torch.from_numpy(samples.prompts[i]),
            "pooled_prompt_embeds": torch.from_numpy(samples.pooled[i]),
            "length": samples.lengths[i],
        }
        _torch_gzip_save(text, root / "text" / f"{samples.text_keys[i]}.pt.gz")
    return time.perf_counter() - started


def read_torch_gzip(root: Path, order: list[tuple[str, str]]) -> float:
    started = time.perf_counter()
    for key, text_key in order:
        with gzip.open(root / "latents" / f"{key}.pt.gz", "rb") as f:
            torch.load(f)
        with gzip.open(root / "text" / f"{text_key}.pt.gz", "rb") as f:
            torch.load(f)
    return time.perf_counter() - started


def sample_bytes(samples: Samples, i: int) -> bytes:
    return samples.latents[i].tobytes() + samples.prompts[i].tobytes() + samples.pooled[i].tobytes()


def write_raw(samples: Samples, path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(len(samples.keys)):
            f.write(sample_bytes(samples, i))
    return time.perf_counter() - started


def read_raw(path: Path, count: int) -> float:
    """One read per sample, in file order, into arrays (views: no copy)."""
    sizes = [int(np.prod(LATENT_SHAPE)) * 2, TOKENS * WIDTH * 2, POOLED * 2]
    started = time.perf_counter()
    with open(path, "rb") as f:
        for _ in range(count):
            data = f.read(sum(sizes))
            np.frombuffer(data, np.float16, sizes[0] // 2).reshape(LATENT_SHAPE)
            np.frombuffer(data, np.float16, sizes[1] // 2, sizes[0]).reshape(TOKENS, WIDTH)
            np.frombuffer(data, np.float16, sizes[2] // 2, sizes[0] + sizes[1])
    return time.perf_counter() - started


def decompress_floor(samples: Samples, order: list[int]) -> float:
    """zstd alone: the same three arrays per sample as frames in memory, decompressed in the
    reading order into new arrays, as CacheReader does after its reads."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    frames = [
        [(compress(a, cctx), a.dtype, a.shape) for a in (samples.latents[i], samples.prompts[i], samples.pooled[i])]
        for i in order
    ]
    started = time.perf_counter()
    for sample in frames:
        for frame, dtype, shape in sample:
            decompress(frame, dtype, shape)
    return time.perf_counter() - started


def disk_usage(root: Path) -> tuple[int, int]:
    """(apparent bytes, bytes of the blocks allocated) of every file under root."""
    apparent = allocated = 0
    for path in [root] if root.is_file() else root.rglob("*"):
        if path.is_file():
            st = path.stat()
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def warm(root: Path) -> None:
    for path in [root] if root.is_file() else root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(8 * 1024 * 1024):
                    pass
