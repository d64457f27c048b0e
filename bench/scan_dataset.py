"""bench/scan.py's dataset: a pool of generated images in every format, aspect and texture, copied (each copy tagged so
no two files are equal) into directories of FILES_PER_DIR up to the asked count; made once and reused."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageChops

from stk.datagen import save

DATASET_VERSION = 1
FILES_PER_DIR = 500


ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)


@dataclass(frozen=True)
class PoolImage:
    """One distinct image of the pool: its stored file and how it was made."""

    name: str
    width: int  # as displayed, after EXIF orientation
    height: int
    fmt: str
    orientation: int
    seed: int


def pool_plan(count: int, seed: int) -> list[PoolImage]:
    """Sizes, formats and orientations of the pool: 3 JPEG for 1 PNG, long sides log-uniform
    (JPEG 512-4096 px, PNG 512-1600 px so PNGs stay a few MB), about 1 in 7 rotated."""
    rng = random.Random(seed)
    plan = []
    for i in range(count):
        fmt = "PNG" if i % 4 == 3 else "JPEG"
        top = 4096 if fmt == "JPEG" else 1600
        long_side = round(math.exp(rng.uniform(math.log(512), math.log(top))))
        short_side = max(512, round(long_side / rng.choice(ASPECTS)))
        width, height = (long_side, short_side) if rng.random() < 0.6 else (short_side, long_side)
        orientation = 6 if rng.random() < 0.15 else 1
        ext = ".jpg" if fmt == "JPEG" else ".png"
        plan.append(PoolImage(f"{i:04d}{ext}", width, height, fmt, orientation, seed * 100_000 + i))
    return plan


def textured_image(width: int, height: int, seed: int, grain: float) -> Image.Image:
    """A gradient with blotches and film grain: compresses like a photo, unlike a plain gradient.
    Pillow's noise is not seeded, so pixels differ between generations; sizes and formats do not."""
    rng = random.Random(seed)
    channels = []
    for _ in range(3):
        blotches = Image.effect_noise((max(width // 32, 2), max(height // 32, 2)), 60)
        blotches = blotches.resize((width, height), Image.Resampling.BICUBIC)
        gradient = Image.linear_gradient("L").rotate(rng.choice((0, 90, 180, 270))).resize((width, height))
        fine = Image.effect_noise((width, height), grain)
        channels.append(ImageChops.add(Image.blend(blotches, gradient, 0.5), fine, 1.0, -128))
    return Image.merge("RGB", channels)


def make_pool_image(spec: PoolImage, directory: str) -> None:
    """Write one pool image; JPEG at quality 90, PNG with less grain (PNG is lossless)."""
    grain = 10 if spec.fmt == "JPEG" else 5
    image = textured_image(spec.width, spec.height, spec.seed, grain)
    save(image, os.path.join(directory, spec.name), spec.fmt, spec.orientation, quality=90)


def tagged(data: bytes, fmt: str, tag: bytes) -> bytes:
    """`data` with `tag` in a JPEG COM segment (after the APPn segments) or a PNG tEXt chunk
    (after IHDR): the file differs from its siblings and its header stays valid."""
    if fmt == "JPEG":
        pos = 2
        while data[pos] == 0xFF and 0xE0 <= data[pos + 1] <= 0xEF:
            pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        return data[:pos] + b"\xff\xfe" + (len(tag) + 2).to_bytes(2, "big") + tag + data[pos:]
    body = b"tEXt" + b"Comment\x00" + tag
    chunk = (len(body) - 4).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")
    ihdr_end = 8 + 4 + 4 + 13 + 4
    return data[:ihdr_end] + chunk + data[ihdr_end:]


def _manifest_ok(path: Path, expected: dict[str, object]) -> bool:
    try:
        return bool(json.loads(path.read_text()) == expected)
    except (OSError, ValueError):
        return False


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def ensure_pool(data: Path, count: int, seed: int) -> list[PoolImage]:
    """The pool under DATA/pool, generated on all cores unless a complete one is there."""
    plan = pool_plan(count, seed)
    directory, manifest = data / "pool", data / "pool.json"
    expected: dict[str, object] = {"version": DATASET_VERSION, "count": count, "seed": seed}
    if _manifest_ok(manifest, expected) and _count_files(directory) == count:
        return plan
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as workers:
        list(workers.map(make_pool_image, plan, [str(directory)] * count))
    manifest.write_text(json.dumps(expected))
    return plan


def ensure_dataset(data: Path, images: int, pool_size: int, seed: int) -> Path:
    """DATA/images-N: `images` tagged copies of pool images, FILES_PER_DIR per sub-directory;
    reused when its manifest matches and every file is there."""
    root, manifest = data / f"images-{images}", data / f"images-{images}.json"
    expected: dict[str, object] = {"version": DATASET_VERSION, "images": images, "pool": pool_size, "seed": seed}
    if _manifest_ok(manifest, expected) and _count_files(root) == images:
        print(f"dataset: reusing {root}", flush=True)
        return root
    started = time.perf_counter()
    print(f"dataset: generating a pool of {pool_size} images and {images} copies in {root} ...", flush=True)
    manifest.unlink(missing_ok=True)
    plan = ensure_pool(data, pool_size, seed)
    pool = [(spec, (data / "pool" / spec.name).read_bytes()) for spec in plan]
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    for i in range(images):
        spec, content = pool[rng.randrange(len(pool))]
        path = root / f"part-{i // FILES_PER_DIR:03d}" / f"{i:06d}{Path(spec.name).suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tagged(content, spec.fmt, f"stk-bench copy {i}".encode()))
    manifest.write_text(json.dumps(expected))
    print(f"dataset: done in {time.perf_counter() - started:.0f} s", flush=True)
    return root


def list_images(root: Path) -> list[Path]:
    """Every file under `root`, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file())
