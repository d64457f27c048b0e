"""Benchmark stk-scan side by side with what trainers do today and with raw I/O.

    python bench/scan.py [--images 20000] [--data DIR] [--sample 300] [--quick]

One run measures, on the same generated dataset:

  * stk-scan on 1 rank (the real CLI in a subprocess) for several --threads values, reporting
    both the scan-phase rate from its JSON summary and the rate over the process wall time;
  * stk-scan under `mpiexec -n 2`;
  * "full decode": Pillow open + load() + ImageOps.exif_transpose + size, single process, on a
    random sample of the files (a full pass would take far too long);
  * "64 KiB limit": open, read(65536), close on every file, single process;

then prints the ratios against the targets with PASS/FAIL. Every warm measurement follows a
warm-up pass that reads the first 64 KiB and the last 4 KiB of every file (all that stk-scan
and the 64 KiB pass touch), so they are compared with the same page cache. When the page cache
can be dropped (root, /proc/sys/vm/drop_caches writable), a cold pass is measured as well.

The dataset is a pool of distinct textured JPEG and PNG images of 512-4096 px sides (some with
EXIF orientation 6), written as byte copies over sub-directories, each copy made unique by a
JPEG COM segment or a PNG tEXt chunk. It is cached under --data and reused while complete.
A second table takes one 3000x2000 file of every format stk reads (`--formats-only` runs just that
part): microseconds per header read against a full decode of the same file, and the bytes the
header read took against the file size.

The script always exits 0: it is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import PIL
from PIL import ImageOps
from scan_dataset import ensure_dataset, list_images, pool_plan, textured_image
from scan_measure import STK_DEFAULT_THREADS, Measurement, Results, load_average, measure, stk_version

from stk.datagen import FORMAT_SAMPLES, FORMATS, save
from stk.images.formats import open_image, ready_pillow
from stk.images.info import read_header

TARGETS = {"full_decode": 50.0, "limit": 0.5, "ranks": 1.7}


def _rate(value: float | None) -> str:
    """A rate for the table: thousands separated, blank when there is none."""
    return "" if value is None else f"{value:,.0f}"


def print_table(rows: list[Measurement]) -> None:
    """The measurements, one line each."""
    print(f"{'measurement':<38} {'cache':<5} {'files':>6} {'runs':>4} {'s':>7} {'img/s':>8} ", end="")
    print(f"{'wall s':>7} {'wall img/s':>10}")
    for m in rows:
        wall = "" if m.wall is None else f"{m.wall:.2f}"
        print(
            f"{m.name:<38} {m.cache:<5} {m.files:>6} {m.runs:>4} {m.seconds:>7.2f} {_rate(m.rate):>8} {wall:>7} "
            f"{_rate(m.wall_rate):>10}"
        )


def print_ratio(label: str, top: Measurement | None, bottom: Measurement | None, target: float) -> None:
    """top/bottom by rate (judged against the target) and by wall-time rate where there is one."""
    if top is None or bottom is None:
        return
    ratio = top.rate / bottom.rate
    wall = (top.wall_rate or top.rate) / (bottom.wall_rate or bottom.rate)
    verdict = "PASS" if ratio >= target else "FAIL"
    print(f"  {label:<26} {top.cache:<5} {ratio:>8.2f}x   (wall {wall:>7.2f}x)   target >= {target:g}x   {verdict}")


def report(results: Results, files: int, cannot_drop: str | None) -> None:
    """The table, the ratios against the targets, and the checks of every stk-scan run."""
    print()
    print_table(results.rows)
    print(
        "\n's' is the scan phase for stk-scan (from its JSON summary: listing, probing, writing the outputs)\n"
        "and the timed loop for the baselines, which are handed the file list; 'wall s' is the whole\n"
        "stk-scan process (interpreter start, imports, MPI start-up). Runs > 1: the median is shown."
    )
    print(f"\nratios (stk-scan at the default --threads {STK_DEFAULT_THREADS}; PASS/FAIL is judged on 's'):")
    for cache in ("warm", "cold"):
        one = results.find("stk", cache, 1, STK_DEFAULT_THREADS)
        two = results.find("stk", cache, 2, STK_DEFAULT_THREADS)
        print_ratio("stk-scan / full decode", one, results.find("decode", cache), TARGETS["full_decode"])
        print_ratio("stk-scan / 64 KiB limit", one, results.find("limit", cache), TARGETS["limit"])
        print_ratio("2 ranks / 1 rank", two, one, TARGETS["ranks"])
    if results.find("stk", "warm", 2, STK_DEFAULT_THREADS) is None:
        print("  2 ranks / 1 rank: not measured, no mpiexec found")
    one_rank = [m for m in results.rows if m.what == "stk" and m.cache == "warm" and m.ranks == 1]
    best = max(one_rank, key=lambda m: m.rate)
    print(
        f"\nfastest warm 1-rank run: --threads {best.threads} ({best.rate:,.0f} img/s; default {STK_DEFAULT_THREADS})"
    )

    problems = []
    for run in results.scans:
        s = run.summary
        if s["scanned"] != files or s["errors"] != 0:
            problems.append(f"scanned {s['scanned']} of {files} files, {s['errors']} errors {s['error_kinds']}")
        wrong = [p for p, size in results.decoded.items() if run.sizes.get(p) != size]
        if wrong:
            problems.append(f"{len(wrong)} sampled sizes differ from full decode, e.g. {wrong[0]}")
    if problems:
        print("check: FAIL\n  " + "\n  ".join(problems))
    else:
        print(
            f"check: all {len(results.scans)} stk-scan runs scanned all {files} files without errors and agree "
            f"with full decode on the {len(results.decoded)} sampled sizes"
        )
    cold = "after drop_caches" if cannot_drop is None else f"not measured (cannot drop caches: {cannot_drop})"
    print(f"page cache: warm rows after a warm-up pass; cold rows {cold}")


class CountingFile(io.FileIO):
    """A file that counts the bytes read through it."""

    read_bytes = 0

    def readinto(self, buffer: Any) -> int:  # type: ignore[override]
        count = super().readinto(buffer) or 0
        self.read_bytes += count
        return count

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def per_format(root: Path, repeat: int) -> None:
    """One file per format: header read against full decode, and bytes read against file size."""
    root.mkdir(parents=True, exist_ok=True)
    image = textured_image(3000, 2000, seed=5, grain=0.5)
    files = {fmt: root / f"big{ext}" for fmt, ext in FORMATS.items()}
    files.update({fmt: root / f"big{ext}" for fmt, (ext, _) in FORMAT_SAMPLES.items()})
    ready_pillow()  # the HEIC and JPEG XL writers
    for fmt, path in files.items():
        if path.exists():
            continue
        if fmt in FORMATS:
            save(image, str(path), fmt)
        else:
            image.save(path, fmt)
    print(f"\nper format: one 3000x2000 file each, best of {repeat} runs")
    columns = ("file KB", 9), ("header us", 10), ("decode us", 11), ("ratio", 8), ("read KB", 8), ("read %", 7)
    print(f"{'format':<10}" + "".join(f" {name:>{width}}" for name, width in columns))
    for fmt, path in files.items():
        size = path.stat().st_size
        header_s, decode_s, read = math.inf, math.inf, 0
        for _ in range(repeat):
            with CountingFile(path) as f:
                started = time.perf_counter()
                header = read_header(f, size)  # type: ignore[arg-type]
                header_s = min(header_s, time.perf_counter() - started)
                read = f.read_bytes
            started = time.perf_counter()
            with open(path, "rb") as f, open_image(f) as im:
                decoded = ImageOps.exif_transpose(im).size
            decode_s = min(decode_s, time.perf_counter() - started)
        check = "" if decoded == (header.width, header.height) else f"  SIZE DIFFERS: {decoded}"
        print(
            f"{fmt:<10} {size / 1e3:>9,.0f} {header_s * 1e6:>10,.0f} {decode_s * 1e6:>11,.0f} "
            f"{decode_s / header_s:>7,.0f}x {read / 1e3:>8.1f} {100 * read / size:>6.2f}%{check}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--images", type=int, default=20_000, help="files in the dataset")
    parser.add_argument("--data", metavar="DIR", type=Path, default=Path("/tmp/stk-bench-scan"), help="dataset cache")
    parser.add_argument("--sample", type=int, default=300, help="files decoded by the full-decode baseline")
    parser.add_argument("--pool", type=int, default=200, help="distinct images the files are copies of")
    parser.add_argument("--threads", default="1,4,8", help="--threads values for the 1-rank runs (8 is always run)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per warm measurement; the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset plan and of the sample")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2000 images, 100 sampled, 1 run each")
    parser.add_argument("--formats-only", action="store_true", help="only the per-format table")
    args = parser.parse_args()
    if args.formats_only:
        per_format(args.data / "formats", args.repeat)
        return
    if args.quick:
        args.images, args.sample, args.repeat = 2000, min(args.sample, 100), 1

    args.data.mkdir(parents=True, exist_ok=True)
    source = ensure_dataset(args.data, args.images, args.pool, args.seed)
    paths = list_images(source)
    sizes = sorted(p.stat().st_size for p in paths)
    sample = random.Random(args.seed).sample(paths, min(args.sample, len(paths)))
    plan = pool_plan(args.pool, args.seed)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"\nmachine: {os.cpu_count()} cores, {ram:.0f} GiB RAM, {platform.platform()}")
    print(f"software: Python {platform.python_version()}, Pillow {PIL.__version__}, stk {stk_version()}")
    print(
        f"dataset: {source}: {len(paths)} files, {sum(sizes) / 2**30:.1f} GiB, file size min/median/max "
        f"{sizes[0] / 1e6:.2f}/{sizes[len(sizes) // 2] / 1e6:.2f}/{sizes[-1] / 1e6:.2f} MB; copies of "
        f"{len(plan)} distinct images ({sum(s.fmt == 'JPEG' for s in plan)} JPEG q90, "
        f"{sum(s.fmt == 'PNG' for s in plan)} PNG, {sum(s.orientation == 6 for s in plan)} with EXIF orientation 6)"
    )
    print(f"load average before: {load_average()}; other work on the machine slows every row\n", flush=True)
    results, cannot_drop = measure(source, paths, sample, args)
    report(results, len(paths), cannot_drop)
    per_format(args.data / "formats", args.repeat)


if __name__ == "__main__":
    main()
