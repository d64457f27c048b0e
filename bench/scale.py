"""Benchmark stk at scale: wall time and peak RSS per rank of each stage that touches every image, at two sizes side by
side, with the floors, the linear extrapolation to 100M images (and to 100M over 32 ranks) and the targets.

    python bench/scale.py [--sizes 1000000,10000000] [--s3-sizes 100000,1000000] [--ranks 2] [--data DIR]
                          [--only table,nocap,dir,s3,cache,train]

Every command runs as users run it (a subprocess, under `mpiexec -n RANKS` for the multi-rank stages), on data made
once under --data and reused: N files that are hard links to 4 real JPEGs (1000 to a directory), a table of their paths,
captions and sizes, the same N images as objects on a local S3 server (SeaweedFS `weed mini`, as the tests start it),
and a synthetic cache of N samples (no model needed: latents repeat those of a tiny SD model's cache of the 4 images).

  * table: stk-scan of the table with sizes, 1 rank; floor: read the table and os.stat every path on 8 threads, its
    second pass timed (the first warms the page and inode caches, for stk-scan too, which runs after it);
  * nocap: the same scan of the table without its caption column (stk-scan looks for sidecar captions), same floor;
  * dir: stk-scan of the directory, RANKS ranks;
  * s3: stk-scan of the bucket, RANKS ranks, at --s3-sizes; its listing (from the start of its work, its summary
    line's time less the seconds it reports, to its "N images listed" line) against the floor, one plain sequential
    ListObjectsV2 loop;
  * cache: stk-cache of the table's scan with a tiny SD model, 1 rank, up to its plan ("... batches on N rank(s)"),
    then killed: its planning still needs the model's tokenizers, so the model's load is in the time;
  * train: stk-train of the synthetic cache with the tiny model, RANKS ranks, 1 step: the time to its "DeepSpeed
    ZeRO stage" line (setup, the sample index included), the peak over the whole run.

Bytes per image is the growth of a rank's peak RSS from the smaller size to the larger, per image (what the 100M
projection extends); peak/N, which carries the interpreter and its imports, is shown beside it. A missed target is
printed as FAIL; the script fails only when a command does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from scale_data import S3_PREFIX, ensure_bucket, ensure_files, s3_client, start_s3, without_captions
from scale_measure import Run, measured
from scale_report import Row, report
from scan_measure import load_average, stk_version
from support.commands import cache_command, cache_env, scan_command, scan_env, train_command, train_env

FLOORS = [sys.executable, str(Path(__file__).resolve().parent / "scale_floors.py")]
LISTED, SUMMARY = r"\d+ images listed", r"\d+ files: .* reused in [\d.]+ s"
STAGES = ("table", "nocap", "dir", "s3", "cache", "train")


def _checked(run: Run, what: str) -> Run:
    if run.returncode not in (0, None):
        raise SystemExit(f"{what} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return run


def _scan(source: str, out: Path, ranks: int, *more: str) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    args = [source, "--out", str(out), "--family", "sd", "--allow-oversubscription", *more]
    return _checked(
        measured(scan_command(args, ranks if ranks > 1 else 0), scan_env(), {"listed": LISTED, "summary": SUMMARY}),
        "stk-scan",
    )


def _scan_row(stage: str, ranks: int, scan: Run, floor: tuple[Run, dict[str, float]] | None = None) -> Row:
    """A scan's row: its own seconds (its JSON summary: without start-up and imports), and its listing's, from the
    start of that work (its summary line's time less its seconds) to its "N images listed" line."""
    summary = json.loads(scan.stdout.strip().splitlines()[-1])
    work = float(summary["seconds"])
    row = Row(stage, summary["files"], ranks, scan.seconds, scan.peaks, work)
    row.listing = scan.marks["listed"] - (scan.marks["summary"] - work)
    if floor is not None:
        row.floor, row.floor_peak = floor[1]["seconds"], floor[0].peak()
    return row


def _floor(*args: str) -> tuple[Run, dict[str, float]]:
    """A floor's run and what it printed: the count, and its seconds without start-up and imports."""
    run = _checked(measured([*FLOORS, *args], scan_env()), "floor")
    return run, json.loads(run.stdout)


def table_and_dir(args: argparse.Namespace, n: int, rows: list[Row]) -> None:
    tree, table = ensure_files(args.data, n)
    run = args.data / "run"
    floor = _floor("stat", str(table), str(args.data)) if {"table", "nocap"} & args.only else None
    if "table" in args.only:
        rows.append(_scan_row("table", 1, _scan(str(table), run / f"scan-table-{n}", 1), floor))
    if "nocap" in args.only:
        rows.append(_scan_row("nocap", 1, _scan(str(without_captions(table)), run / f"scan-nocap-{n}", 1), floor))
    if "dir" in args.only:
        scan = _scan(str(tree), run / f"scan-dir-{n}", args.ranks)
        rows.append(_scan_row("dir", args.ranks, scan))
    if "cache" in args.only:
        scanned = run / f"scan-table-{n}"
        if not (scanned / "metadata.parquet").exists():
            _scan(str(table), scanned, 1)
        from scale_cache import tiny_model  # torch and diffusers: only for the stages that load a model

        out = run / f"cache-{n}"
        shutil.rmtree(out, ignore_errors=True)
        command = cache_command([str(scanned), "--model", tiny_model(args.data), "--out", str(out), "-v"])
        plan = _checked(measured(command, cache_env(), {"plan": r"batches on \d+ rank"}, stop="plan"), "stk-cache")
        rows.append(Row("cache", n, 1, plan.seconds, plan.peaks))


def s3(args: argparse.Namespace, n: int, rows: list[Row]) -> None:
    client = s3_client(args.server.endpoint)
    url = ensure_bucket(args.data, client, n)
    endpoint = ["--s3-endpoint-url", args.server.endpoint]
    floor, printed = _floor("list", args.server.endpoint, f"scale-{n}", S3_PREFIX)
    if printed["count"] != n:
        raise SystemExit(f"{url}: the floor listed {printed['count']} keys, not {n}")
    scan = _scan(url, args.data / "run" / f"scan-s3-{n}", args.ranks, *endpoint)
    rows.append(_scan_row("s3", args.ranks, scan, (floor, printed)))


def train(args: argparse.Namespace, n: int, rows: list[Row]) -> None:
    from scale_cache import synthetic_cache, tiny_model  # torch and diffusers: only for the stages that load a model

    cache, out = synthetic_cache(args.data, n), args.data / "run" / f"train-{n}"
    shutil.rmtree(out, ignore_errors=True)
    more = ["--max-steps", "1", "--batch-size", "1", "--precision", "fp32", "--no-validation"]
    command = train_command(
        ["--cache", cache, "--model", tiny_model(args.data), "--output-dir", out, *more], args.ranks
    )
    run = _checked(measured(command, train_env(), {"setup": r"DeepSpeed ZeRO stage"}), "stk-train")
    rows.append(Row("train", n, args.ranks, run.marks.get("setup", run.seconds), run.peaks))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--sizes", default="1000000,10000000", help="image counts, smaller first")
    parser.add_argument(
        "--s3-sizes", default="100000,1000000", help="key counts of the s3 stage (10M uploads take hours on one server)"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the dir, s3 and train stages")
    parser.add_argument("--data", type=Path, default=Path("/tmp/stk-bench-scale"), help="data made once, reused")
    parser.add_argument("--only", default=",".join(STAGES), help="stages to run")
    args = parser.parse_args()
    sizes = {int(s) for s in args.sizes.split(",")}
    s3_sizes = {int(s) for s in args.s3_sizes.split(",")} if "s3" in args.only else set()
    args.only = set(args.only.split(","))
    args.data.mkdir(parents=True, exist_ok=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {os.cpu_count()} cores, {ram:.0f} GiB RAM, {platform.platform()}; stk {stk_version()}")
    print(f"load average before: {load_average()}", flush=True)
    rows: list[Row] = []
    args.server = start_s3(args.data) if "s3" in args.only else None
    try:
        for n in sorted(sizes | s3_sizes):
            print(f"size {n:,}", flush=True)
            if n in sizes:
                table_and_dir(args, n, rows)
            if n in s3_sizes and args.server is not None:
                s3(args, n, rows)
            if n in sizes and "train" in args.only:
                train(args, n, rows)
    finally:
        if args.server is not None:
            args.server.stop()
    report(rows)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
