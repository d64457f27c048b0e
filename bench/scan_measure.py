"""bench/scan.py's measurements: header reads and full decodes against stk-scan (threads and ranks), with cold or warm
page caches."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image, ImageOps

HEAD_BYTES = 64 * 1024
TAIL_BYTES = 4096
STK_DEFAULT_THREADS = 8


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
