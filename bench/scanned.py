"""What stk-cache's check that an image is the one stk-scan saw costs, beside the decode it guards.

    python bench/scanned.py [--images 300] [--side 512]

One run, on the same generated JPEGs in a temporary folder, warm page cache: each image decoded and fitted to its
bucket as stk-cache does it (stk.images.preprocess), then through stk.shards.scanned.read_as_scanned (a stat, the size
and mtime compared, the same decode, the decoded size compared). Prints both times per image and their ratio. Exits 0: a
report.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from stk.images.preprocess import CropMode, preprocess
from stk.shards.scanned import SeenFile, read_as_scanned


def _images(folder: Path, count: int, side: int) -> list[tuple[Path, SeenFile]]:
    rng = np.random.default_rng(0)
    made = []
    for i in range(count):
        path = folder / f"{i}.jpg"
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(path, quality=90)
        info = os.stat(path)
        made.append((path, SeenFile(info.st_size, info.st_mtime, None, side, side)))
    return made


def _per_image(images: list[tuple[Path, SeenFile]], side: int, checked: bool) -> float:
    started = time.perf_counter()
    for path, seen in images:
        if checked:
            read_as_scanned(str(path), seen, side, side, CropMode.CENTER, path.name)
        else:
            with open(path, "rb") as f:
                preprocess(f, side, side, CropMode.CENTER, path.name)
    return (time.perf_counter() - started) / len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--side", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        images = _images(Path(folder), args.images, args.side)
        _per_image(images, args.side, checked=False)  # warm the page cache
        plain = min(_per_image(images, args.side, checked=False) for _ in range(3))
        checked = min(_per_image(images, args.side, checked=True) for _ in range(3))
    print(f"{args.images} JPEGs {args.side}x{args.side}, best of 3 passes, ms per image:")
    print(f"  decode + fit (stk.images.preprocess):        {plain * 1e3:.3f}")
    print(f"  checked against the scan row first:   {checked * 1e3:.3f}")
    print(f"  ratio checked / plain:                {checked / plain:.3f}x")


if __name__ == "__main__":
    main()
