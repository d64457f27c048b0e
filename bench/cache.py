"""Benchmark stk's cache shards side by side with what trainers do today and with raw I/O.

    python bench/cache.py [--samples 10000] [--images 300] [--data DIR] [--quick]

One run, on the same generated samples (per sample: an fp16 latent 4x64x64 and a text embedding
of 77x768 fp16 + a pooled 1280 fp16, caption lengths 8/16/24/40/77, padded to 77):

  * stk: written through ShardWriter, then all samples read in random order through
    CacheReader (the latent, then its text embedding), single thread;
  * (a) today's trainers: one torch.save file per latent and per text embedding, through gzip
    level 9 (<key>.pt.gz), read in the same random order with torch.load;
  * (b) the limit: the same uncompressed bytes in one file, read sequentially sample by sample;
  * (c) the codec's floor: the same arrays as zstd frames in memory, only decompressed;
  * bytes on disk of each (apparent size, and blocks allocated);
  * the byte-shuffle question: HDF5 Zstd alone, Zstd after the shuffle filter, and Blosc2
    zstd + byte shuffle on the latents (write, size, random read through plain h5py);
  * the write path with a trivial encoder: decode + resize to 512x512 of generated JPEGs alone,
    against decode + resize + an 8x8 average pool to 4x64x64 fp16 written into shards.

Latents are a smooth field plus noise (like a VAE's: fp16 mantissas are noise); a text
embedding's real tokens are random and its padding rows repeat one row. Every read is timed
with a warm page cache, after a pass that reads every file once. The script always exits 0: it
is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import PIL
import torch
from cache_layouts import (
    SHARD_SIZE,
    check_stk,
    decompress_floor,
    disk_usage,
    make_samples,
    read_raw,
    read_stk,
    read_torch_gzip,
    sample_bytes,
    warm,
    write_raw,
    write_stk,
    write_torch_gzip,
)
from PIL import Image, ImageChops, ImageOps

from stk.shards import LatentRecord, Manifest, ShardInfo, ShardWriter
from stk.shards.layout import ZSTD_LEVEL
from stk.shards.manifest import shard_entry

IMAGE_SIDE = 512
TARGETS = {"vs_torch_gzip": 20.0, "vs_limit": 0.5, "write_overhead": 0.20}


# --------------------------------------------------------------------- shuffle or not


@dataclass
class FilterRow:
    name: str
    write_us: float
    ratio: float
    read_us: float


def compare_filters(latents: np.ndarray, scratch: Path, seed: int) -> list[FilterRow]:
    """Each candidate as a plain h5py writer would use it: resize + write one sample at a time."""
    candidates: dict[str, dict[str, object]] = {
        f"zstd {ZSTD_LEVEL} (hdf5plugin.Zstd)": dict(hdf5plugin.Zstd(clevel=ZSTD_LEVEL)),
        f"byte shuffle + zstd {ZSTD_LEVEL}": {**hdf5plugin.Zstd(clevel=ZSTD_LEVEL), "shuffle": True},
        f"blosc2 zstd {ZSTD_LEVEL} + byte shuffle": dict(
            hdf5plugin.Blosc2(cname="zstd", clevel=ZSTD_LEVEL, filters=hdf5plugin.Blosc2.SHUFFLE)
        ),
    }
    order = np.random.default_rng(seed).permutation(len(latents))
    rows = []
    for name, options in candidates.items():
        path = scratch / "filters.h5"
        started = time.perf_counter()
        with h5py.File(path, "w") as f:
            shape = latents.shape[1:]
            ds = f.create_dataset(
                "mean", (0, *shape), maxshape=(None, *shape), chunks=(1, *shape), dtype=latents.dtype, **options
            )
            for i, latent in enumerate(latents):
                ds.resize(i + 1, axis=0)
                ds[i] = latent
        write = time.perf_counter() - started
        ratio = path.stat().st_size / latents.nbytes
        with h5py.File(path, "r") as f:
            ds = f["mean"]
            started = time.perf_counter()
            for i in order:
                ds[i]
            read = time.perf_counter() - started
        path.unlink()
        rows.append(FilterRow(name, write / len(latents) * 1e6, ratio, read / len(latents) * 1e6))
    return rows


# ------------------------------------------------------------------------- write path


def make_jpegs(directory: Path, count: int, seed: int) -> list[Path]:
    """Photo-like JPEGs (q90) of 640-1600 px sides, reused while complete."""
    stamp = directory / "done.json"
    expected = {"count": count, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == expected:
        return sorted(directory.glob("*.jpg"))
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        width, height = (int(x) for x in rng.integers(640, 1600, 2))
        channels = []
        for _ in range(3):
            blotches = Image.effect_noise((width // 32, height // 32), 60).resize(
                (width, height), Image.Resampling.BICUBIC
            )
            gradient = Image.linear_gradient("L").rotate(int(rng.integers(4)) * 90).resize((width, height))
            grain = Image.effect_noise((width, height), 10)
            channels.append(ImageChops.add(Image.blend(blotches, gradient, 0.5), grain, 1.0, -128))
        Image.merge("RGB", channels).save(directory / f"{i:05d}.jpg", quality=90)
    stamp.write_text(json.dumps(expected))
    return sorted(directory.glob("*.jpg"))


def decode_resize(path: Path) -> tuple[Image.Image, tuple[int, int]]:
    with Image.open(path) as image:
        image = ImageOps.exif_transpose(image).convert("RGB")
        return ImageOps.fit(image, (IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BICUBIC), (image.height, image.width)


def trivial_encoder(image: Image.Image) -> np.ndarray:
    """512x512 RGB -> (4, 64, 64) float16: an 8x8 average pool (Image.reduce), RGB + luminance."""
    pooled = np.asarray(image.reduce(8), dtype=np.float32) / 127.5 - 1
    return np.concatenate([pooled.transpose(2, 0, 1), pooled.mean(axis=2)[None]]).astype(np.float16)


def decode_only(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        decode_resize(path)
    return time.perf_counter() - started


def decode_and_write(paths: list[Path], scratch: Path) -> float:
    cache = scratch / "write-path"
    shutil.rmtree(cache, ignore_errors=True)
    manifest = Manifest(config={"bench": "write path"})

    def done(info: ShardInfo) -> None:
        manifest.merge([shard_entry(info)])
        manifest.save(str(cache))

    started = time.perf_counter()
    with ShardWriter(str(cache), str(cache / "shards"), "r0", SHARD_SIZE, done) as writer:
        for path in paths:
            image, size = decode_resize(path)
            key = hashlib.sha256(str(path).encode()).hexdigest()
            writer.add_latent(LatentRecord(key, key, trivial_encoder(image), None, size, (0, 0), str(path)))
    return time.perf_counter() - started


# ------------------------------------------------------------------------------ report


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def timed(label: str, runs: int, measure: Callable[[], float]) -> float:
    print(f"  {label} ({runs} run{'s' if runs > 1 else ''})", flush=True)
    return statistics.median(measure() for _ in range(runs))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000, help="latents and text embeddings (default 10000)")
    parser.add_argument("--images", type=int, default=300, help="JPEGs for the write path (default 300)")
    parser.add_argument("--data", type=Path, default=Path("/tmp/stk-bench-cache"), help="scratch directory")
    parser.add_argument("--repeat", type=int, default=3, help="runs per fast measurement; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1000 samples, 100 images, 1 run each")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.images, args.repeat = 1000, min(args.images, 100), 1

    args.data.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=args.data))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {os.cpu_count()} cores, {ram:.0f} GiB RAM, {platform.platform()}")
    print(
        f"software: Python {platform.python_version()}, h5py {h5py.version.version} (HDF5 "
        f"{h5py.version.hdf5_version}), hdf5plugin {hdf5plugin.version}, torch {torch.__version__}, "
        f"Pillow {PIL.__version__}"
    )
    print(f"load average before: {load_average()}", flush=True)
    try:
        print(f"\ngenerating {args.samples} samples ...", flush=True)
        samples = make_samples(args.samples, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        order = [int(i) for i in rng.permutation(args.samples)]
        stk_dir, torch_dir, raw_path = scratch / "stk", scratch / "torch-gzip", scratch / "raw.bin"

        print("writing", flush=True)
        writes = {
            "stk": write_stk(samples, stk_dir),
            "torch gzip": write_torch_gzip(samples, torch_dir),
            "raw": write_raw(samples, raw_path),
        }
        wrong = check_stk(stk_dir, samples)
        for root in (stk_dir, torch_dir, raw_path):
            warm(root)
        print("reading (warm page cache)", flush=True)
        reads = {
            "stk": timed("stk", args.repeat, lambda: read_stk(stk_dir, [samples.keys[i] for i in order])),
            "torch gzip": timed(
                "torch gzip",
                1,
                lambda: read_torch_gzip(torch_dir, [(samples.keys[i], samples.text_keys[i]) for i in order]),
            ),
            "raw": timed("raw", args.repeat, lambda: read_raw(raw_path, args.samples)),
            "zstd": timed("zstd floor", args.repeat, lambda: decompress_floor(samples, order)),
        }
        sizes = {"stk": disk_usage(stk_dir), "torch gzip": disk_usage(torch_dir), "raw": disk_usage(raw_path)}

        print("byte shuffle or not", flush=True)
        filters = compare_filters(samples.latents[: min(args.samples, 2000)], scratch, args.seed)

        print(f"write path: {args.images} JPEGs", flush=True)
        paths = make_jpegs(args.data / f"jpegs-{args.images}", args.images, args.seed)
        decode_rates, write_rates = [], []
        for _ in range(args.repeat):  # alternated, so drift hits both alike
            decode_rates.append(len(paths) / decode_only(paths))
            write_rates.append(len(paths) / decode_and_write(paths, scratch))
        decode_rate, write_rate = statistics.median(decode_rates), statistics.median(write_rates)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    n = args.samples
    names = {
        "stk": "stk shards, CacheReader, random order",
        "torch gzip": "(a) torch.save + gzip 9, file per sample, random",
        "raw": "(b) raw bytes, one file, sequential",
        "zstd": "(c) zstd decompress only, from memory, random",
    }
    raw = len(sample_bytes(samples, 0))
    print(f"\n{n} samples: latent 4x64x64 fp16 + text 77x768 fp16 + pooled 1280 fp16 ({raw:,} B raw each)")
    print(f"{'layout':<50} {'write s':>8} {'read s':>7} {'samples/s':>10} {'MiB':>8} {'MiB alloc':>10}")
    for key, name in names.items():
        write = f"{writes[key]:.1f}" if key in writes else ""
        apparent, allocated = (f"{b / 2**20:,.1f}" for b in sizes[key]) if key in sizes else ("", "")
        print(f"{name:<50} {write:>8} {reads[key]:>7.2f} {n / reads[key]:>10,.0f} {apparent:>8} {allocated:>10}")
    print("\nratios:")
    ratios = [
        ("stk / (a) torch gzip, read rate", reads["torch gzip"] / reads["stk"], ">=", TARGETS["vs_torch_gzip"]),
        ("stk / (b) raw limit, read rate", reads["raw"] / reads["stk"], ">=", TARGETS["vs_limit"]),
        ("stk / (c) zstd floor, read rate", reads["zstd"] / reads["stk"], "", 0.0),
        ("stk / (a) bytes, apparent", sizes["stk"][0] / sizes["torch gzip"][0], "<=", 1.0),
        ("stk / (a) bytes, allocated", sizes["stk"][1] / sizes["torch gzip"][1], "<=", 1.0),
    ]
    for label, ratio, sense, target in ratios:
        ok = ratio >= target if sense == ">=" else ratio <= target
        judged = f"   target {sense} {target:g}x   {verdict(ok)}" if sense else "   (no target: how close to the codec)"
        print(f"  {label:<34} {ratio:>8.3f}x{judged}")
    overhead = decode_rate / write_rate - 1
    print(
        f"\nwrite path, {len(paths)} JPEGs (640-1600 px, q90) -> {IMAGE_SIDE}x{IMAGE_SIDE}, 1 thread, "
        f"median of {args.repeat}:"
    )
    print(f"  decode + resize                          {decode_rate:>7.1f} images/s")
    print(f"  decode + resize + encode + shard write   {write_rate:>7.1f} images/s")
    print(
        f"  added by shards + compression + encoder  {overhead:>7.1%}   target < {TARGETS['write_overhead']:.0%}   "
        f"{verdict(overhead < TARGETS['write_overhead'])}"
    )
    print(f"\nbyte shuffle, {min(n, 2000)} latents through plain h5py (resize + write one sample at a time):")
    print(f"  {'filter':<34} {'write us':>9} {'size/raw':>9} {'read us':>8}")
    for row in filters:
        print(f"  {row.name:<34} {row.write_us:>9.0f} {row.ratio:>9.3f} {row.read_us:>8.0f}")
    print(
        f"\ncheck: {'all' if wrong == 0 else 'FAIL:'} {n - wrong} of {n} samples read back bit for bit from the shards"
    )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
