"""bench/scale.py's caches: a seed cache that stk-cache makes of the few real images with a tiny SD model at 64 px, and
from it a synthetic cache of N samples for stk-train's index, written without a model: the seed's manifest (so
stk-train accepts the cache as made with that model), and N latents that repeat the seed's (4x8x8 each) under keys of
their own, all pointing at the seed's caption embeddings."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import replace
from pathlib import Path

from scale_data import real_images
from support.commands import cache_command, cache_env, scan_command, scan_env

from stk.models import Family, build_tiny_model
from stk.shards import CacheReader, Manifest, ShardInfo, ShardWriter
from stk.shards.manifest import shard_entry

SEED_RESOLUTION = 64
SHARD_BYTES = 64 * 1024 * 1024


def _run(command: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stderr[-3000:]}")


def tiny_model(data: Path) -> str:
    """A tiny SD pipeline with random weights: enough for stk-cache's planning and stk-train's setup."""
    model = data / "model-sd"
    if not (model / "model_index.json").exists():
        build_tiny_model(Family.SD, str(model))
    return str(model)


def seed_cache(data: Path) -> Path:
    """The real images scanned at 64 px and cached by stk-cache with the tiny model (made once)."""
    cache = data / "seed-cache"
    if Manifest.load(str(cache)) is None:
        scan = data / "seed-scan"
        real = str(real_images(data)[0].parent)
        resolution = ["--resolution", str(SEED_RESOLUTION), "--family", "sd", "--allow-oversubscription", "-q"]
        _run(scan_command([real, "--out", str(scan), *resolution]), scan_env())
        _run(cache_command([str(scan), "--model", tiny_model(data), "--out", str(cache), "-q"]), cache_env())
    return cache


def synthetic_cache(data: Path, samples: int) -> Path:
    """DATA/cache-N: N samples repeating the seed cache's latents, with the seed's manifest and caption embeddings."""
    cache = data / f"cache-{samples}"
    if Manifest.load(str(cache)) is not None:
        return cache
    print(f"data: a synthetic cache of {samples} samples in {cache} ...", flush=True)
    seed = seed_cache(data)
    template = Manifest.load(str(seed))
    assert template is not None
    manifest = replace(template, shards=[])
    with CacheReader(str(seed)) as reader:
        latents = [reader.latent(key) for key in reader.latent_keys()]
        texts = [reader.text(key) for key in reader.text_keys()]

    def done(info: ShardInfo) -> None:
        manifest.merge([shard_entry(info)])

    with ShardWriter(str(cache), str(cache / "shards"), "r0", SHARD_BYTES, done, manifest.header()) as writer:
        for text in texts:
            writer.add_text(text)
        for i in range(samples):
            like = latents[i % len(latents)]
            key = hashlib.sha256(f"sample {i}".encode()).hexdigest()
            writer.add_latent(replace(like, key=key, path=f"synthetic/{i:08d}.jpg"))
    manifest.save(str(cache))
    return cache
