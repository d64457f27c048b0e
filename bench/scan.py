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
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import PIL
import pyarrow.parquet as pq
from PIL import Image, ImageChops, ImageOps

from stk.datagen import FORMAT_SAMPLES, FORMATS, save
from stk.imageformats import open_image, ready_pillow
from stk.imageinfo import read_header

DATASET_VERSION = 1
FILES_PER_DIR = 500
HEAD_BYTES = 64 * 1024
TAIL_BYTES = 4096
STK_DEFAULT_THREADS = 8
ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)
TARGETS = {"full_decode": 50.0, "limit": 0.5, "ranks": 1.7}


@dataclass(frozen=True)
class PoolImage:
    """One distinct image of the pool: its stored file and how it was made."""

    name: str
    width: int  # as displayed, after EXIF orientation
    height: int
    fmt: str
    orientation: int
    seed: int


@dataclass(frozen=True)
class Measurement:
    """One timed pass over `files` images: `seconds` is what the rate is judged on; `wall` is
    the process wall time of a CLI run."""

    what: str  # "limit", "decode" or "stk"
    cache: str  # "warm" or "cold"
    files: int
    seconds: float
    wall: float | None = None
    ranks: int = 1
    threads: int = 0
    runs: int = 1

    @property
    def name(self) -> str:
        if self.what == "limit":
            return "64 KiB read (the limit), 1 process"
        if self.what == "decode":
            return "full decode, random sample, 1 process"
        return f"stk-scan {self.ranks} rank{'s' if self.ranks > 1 else ''} --threads {self.threads}"

    @property
    def rate(self) -> float:
        return self.files / self.seconds

    @property
    def wall_rate(self) -> float | None:
        return self.files / self.wall if self.wall else None


# ---------------------------------------------------------------------------- dataset


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


# ------------------------------------------------------------------------ measurements


def stk_version() -> str:
    """The commit of the checkout this script is in, '+changes' when stk/ differs from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False).stdout.strip()

    try:
        commit, changed = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "stk")
    except OSError:
        return "(no git)"
    return (commit or "(no commit)") + ("+changes" if changed else "")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, for the report."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def drop_caches() -> str | None:
    """Drop the page cache; the reason it could not be dropped, or None when it was."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def warm_up(paths: list[Path], sample: list[Path]) -> None:
    """Bring into the page cache every byte the measurements read: the first 64 KiB and the
    last 4 KiB of every file (all that stk-scan and the 64 KiB pass touch), the whole sample."""
    for path in paths:
        with open(path, "rb") as f:
            f.read(HEAD_BYTES)
            f.seek(max(os.fstat(f.fileno()).st_size - TAIL_BYTES, 0))
            f.read()
    for path in sample:
        path.read_bytes()


def read_heads(paths: list[Path]) -> float:
    """Seconds to open, read(65536) and close every file."""
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            f.read(HEAD_BYTES)
    return time.perf_counter() - started


def full_decode(paths: list[Path]) -> tuple[float, dict[Path, tuple[int, int]]]:
    """Seconds to decode every file as a trainer does, and the displayed sizes it found."""
    sizes = {}
    started = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            image.load()
            sizes[path] = ImageOps.exif_transpose(image).size
    return time.perf_counter() - started, sizes


@dataclass(frozen=True)
class ScanRun:
    """One stk-scan process: what it printed, how long it ran, and the sizes it wrote."""

    summary: dict[str, Any]  # the JSON summary stk-scan printed
    wall: float
    sizes: dict[str, tuple[int, int]]  # path (relative to the source) -> (width, height)


def mpiexec() -> str | None:
    """The mpiexec next to this Python (the venv's MPICH), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def stk_scan(source: Path, scratch: Path, threads: int, ranks: int) -> ScanRun:
    """Run the stk-scan CLI into a fresh --out directory (deleted afterwards)."""
    out = Path(tempfile.mkdtemp(prefix="out-", dir=scratch))
    command = [sys.executable, "-m", "stk.cli.scan", str(source), "--out", str(out), "--threads", str(threads), "-q"]
    if ranks > 1:
        command = [mpiexec() or "mpiexec", "-n", str(ranks), *command]
    try:
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            sys.exit(f"stk-scan failed ({proc.returncode}): {' '.join(command)}\n{proc.stderr[-4000:]}")
        summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        table = pq.read_table(out / "metadata.parquet", columns=["path", "width", "height"]).to_pydict()
        sizes = {p: (w, h) for p, w, h in zip(table["path"], table["width"], table["height"], strict=True)}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return ScanRun(summary, wall, sizes)


def timed_scan(
    cache: str, source: Path, scratch: Path, threads: int, ranks: int, repeat: int
) -> tuple[Measurement, list[ScanRun]]:
    """The median of `repeat` stk-scan runs (scan phase and wall time taken separately)."""
    print(f"{cache}: stk-scan {ranks} rank(s) --threads {threads}", flush=True)
    runs = [stk_scan(source, scratch, threads, ranks) for _ in range(repeat)]
    seconds = statistics.median(float(r.summary["seconds"]) for r in runs)
    wall = statistics.median(r.wall for r in runs)
    return Measurement("stk", cache, int(runs[0].summary["scanned"]), seconds, wall, ranks, threads, repeat), runs


def timed_heads(paths: list[Path], cache: str, repeat: int) -> Measurement:
    """The median of `repeat` 64 KiB passes over every file."""
    print(f"{cache}: 64 KiB read", flush=True)
    seconds = statistics.median(read_heads(paths) for _ in range(repeat))
    return Measurement("limit", cache, len(paths), seconds, runs=repeat)


@dataclass
class Results:
    """Everything measured, and the stk-scan runs kept for the correctness check."""

    rows: list[Measurement] = field(default_factory=list)
    scans: list[ScanRun] = field(default_factory=list)
    decoded: dict[str, tuple[int, int]] = field(default_factory=dict)  # the sample's sizes by full decode

    def add_scan(self, measured: tuple[Measurement, list[ScanRun]]) -> None:
        self.rows.append(measured[0])
        self.scans.extend(measured[1])

    def find(self, what: str, cache: str, ranks: int = 1, threads: int = 0) -> Measurement | None:
        wanted = (what, cache, ranks, threads)
        return next((m for m in self.rows if (m.what, m.cache, m.ranks, m.threads) == wanted), None)


def measure(
    source: Path, paths: list[Path], sample: list[Path], args: argparse.Namespace
) -> tuple[Results, str | None]:
    """Every measurement; cold ones first when the page cache can be dropped, and the reason
    it cannot otherwise."""
    results = Results()
    ranks = (1, 2) if mpiexec() else (1,)
    cannot_drop = drop_caches()
    if cannot_drop is None:
        results.rows.append(timed_heads(paths, "cold", 1))
        for n in ranks:
            drop_caches()
            results.add_scan(timed_scan("cold", source, args.data, STK_DEFAULT_THREADS, n, 1))
    print("warm: warm-up pass", flush=True)
    warm_up(paths, sample)
    results.rows.append(timed_heads(paths, "warm", args.repeat))
    seconds, sizes = full_decode(sample)
    results.rows.append(Measurement("decode", "warm", len(sample), seconds))
    results.decoded = {str(p.relative_to(source)): size for p, size in sizes.items()}
    for threads in sorted({int(t) for t in args.threads.split(",")} | {STK_DEFAULT_THREADS}):
        results.add_scan(timed_scan("warm", source, args.data, threads, 1, args.repeat))
    if len(ranks) > 1:
        results.add_scan(timed_scan("warm", source, args.data, STK_DEFAULT_THREADS, 2, args.repeat))
    return results, cannot_drop


# ------------------------------------------------------------------------------ report


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
        print(f"{fmt:<10} {size / 1e3:>9,.0f} {header_s * 1e6:>10,.0f} {decode_s * 1e6:>11,.0f} "
              f"{decode_s / header_s:>7,.0f}x {read / 1e3:>8.1f} {100 * read / size:>6.2f}%{check}")  # fmt: skip


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
