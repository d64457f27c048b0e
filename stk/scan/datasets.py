"""stk-scan of several datasets: each scanned with its own settings into `OUT/datasets/<name>/` (an ordinary,
resumable scan directory), then one scan directory of all of them in OUT (stk/scan/combine.py), checked together.

A dataset's field left out takes the command's option, so `[[dataset]]` tables that only name sources scan
like one stk-scan per source with the same options."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pyarrow.parquet as pq

from stk import storage
from stk.buckets import ways_out
from stk.captions import CaptionSource
from stk.cluster.world import World
from stk.datasets import DatasetSpec
from stk.errors import BatchCheckFailed, InputError, check_max_errors, parse_max_errors
from stk.images.info import is_image_name
from stk.log import get_logger
from stk.scan.combine import Scanned, combined_checks, write_combined
from stk.scan.outputs import ERRORS, Tally
from stk.scan.pipeline import ScanOptions, ScanSummary, bucket_settings, run_scan
from stk.scan.reader import read_buckets

__all__ = ["DATASETS_DIR", "check_sources", "dataset_options", "run_datasets"]

log = get_logger("scan")

DATASETS_DIR = "datasets"  # OUT/datasets/<name>/: each dataset's own scan


def dataset_options(spec: DatasetSpec, base: ScanOptions) -> ScanOptions:
    """The scan of one dataset: the command's options with the dataset's own fields over them."""
    given = _given(spec, "resolution", "resolution_type", "min_aspect", "max_aspect", "aspect")
    buckets = replace(base.buckets, **given)
    try:
        buckets.validate()
    except InputError as exc:
        raise InputError(f"dataset {spec.name!r}: {exc}") from None
    probe = replace(base.probe, **_given(spec, "missing_caption", "captions"))
    if spec.caption_extension is not None:
        probe = replace(probe, sidecars=(spec.caption_extension,))
    elif spec.captions is CaptionSource.STEM:
        probe = replace(probe, sidecars=())  # none read: nothing to list or fingerprint
    columns = {**base.columns, "caption": spec.caption_column} if spec.caption_column else base.columns
    return replace(
        base,
        source=spec.source,
        out_dir=os.path.join(base.out_dir, DATASETS_DIR, spec.name),
        table_root=spec.root,
        columns=columns,
        probe=probe,
        buckets=buckets,
        final_checks=False,
        **_given(spec, "min_size", "repeats"),
    )


def _given(spec: DatasetSpec, *names: str) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in names if getattr(spec, name) is not None}


def check_sources(specs: Sequence[DatasetSpec]) -> None:
    """Before any work: every source exists and holds an image (on S3: an object; its images are known once listed)."""
    for spec in specs:
        problem = _source_problem(spec.source)
        if problem:
            raise InputError(f"dataset {spec.name!r}: {problem}")


def _source_problem(source: str) -> str | None:
    if source == "-":
        return "its source cannot be '-' (stdin); give a directory or a table"
    if source.endswith((".parquet", ".jsonl")):
        if not storage.exists(source):
            return f"{source}: no such table"
        return None if storage.is_s3(source) or _table_rows(source) else f"{source} holds no images (an empty table)"
    if storage.is_s3(source):
        return None if next(iter(storage.list_files(source)), None) else f"{source} holds no objects"
    if not os.path.isdir(source):
        return f"{source}: no such directory"
    return None if _holds_image(source) else f"{source} holds no images"


def _table_rows(path: str) -> bool:
    if path.endswith(".parquet"):
        try:
            return pq.ParquetFile(path).metadata.num_rows > 0
        except Exception:  # not parquet: the scan reports it as it does for one source
            return True
    with open(path, "rb") as f:
        return any(line.strip() for line in f)


def _holds_image(directory: str) -> bool:
    """Whether the tree holds one file named as an image: stops at the first, so a real dataset costs a few stats."""
    return any(any(is_image_name(name) for name in files) for _, _, files in os.walk(directory))


def run_datasets(specs: Sequence[DatasetSpec], base: ScanOptions, world: World, source: str) -> dict[str, Any]:
    """Scan every dataset on every rank of `world`, one after the other, then write and check the scan of all of
    them; every rank returns its summary. `source` names the list (the file it came from) in the summary."""
    started = time.monotonic()
    parse_max_errors(base.max_errors, 0)  # a bad value fails now, not after the scans
    world.root_call(lambda: check_sources(specs))
    options = world.root_call(lambda: [dataset_options(spec, base) for spec in specs])  # a bad one before any scan
    scanned = []
    for spec, opts in zip(specs, options, strict=True):
        log.info("dataset %r: %s", spec.name, spec.source)
        scanned_one = run_scan(opts, world)
        buckets = world.root_call(lambda opts=opts: read_buckets(opts.out_dir))  # type: ignore[misc]
        scanned.append(Scanned(spec, opts.out_dir, scanned_one, buckets))
    empty = [one.spec.name for one in scanned if not one.summary.images]
    if empty:
        raise InputError(f"dataset(s) {', '.join(map(repr, empty))} hold no images (see {DATASETS_DIR}/NAME/{ERRORS})")
    total = _total(scanned, base, source, world.size, time.monotonic() - started)
    settings = bucket_settings(base)
    summary = world.root_call(lambda: write_combined(base.out_dir, scanned, total, settings, base.oversubscribe))
    log.info("%d datasets: %s", len(scanned), total.line())
    _final_checks(scanned, total, base)
    return summary


def _total(scanned: Sequence[Scanned], base: ScanOptions, source: str, ranks: int, seconds: float) -> ScanSummary:
    """The datasets' summaries added up."""
    counted = ("files", "images", "errors", "warnings", "skipped", "reused", "scanned", "buckets", "short_buckets")
    sums = {name: sum(getattr(one.summary, name) for one in scanned) for name in counted}
    tally = Tally()
    for one in scanned:
        tally = tally.plus(Tally(error_kinds=one.summary.error_kinds, warning_kinds=one.summary.warning_kinds))
    kinds = {"error_kinds": tally.error_kinds, "warning_kinds": tally.warning_kinds}
    rate = round(sums["scanned"] / seconds, 1) if seconds else 0.0
    totals: dict[str, Any] = {**sums, **kinds, "ranks": ranks, "seconds": round(seconds, 3), "images_per_second": rate}
    return replace(scanned[0].summary, source=source, root="", out_dir=base.out_dir, **totals)


def _final_checks(scanned: Sequence[Scanned], total: ScanSummary, base: ScanOptions) -> None:
    """--max-errors over every dataset's files, then the batch check of each dataset, named (the outputs are
    written by now, as a scan of one source writes them before its checks)."""
    errors_file, written = os.path.join(base.out_dir, ERRORS), "the outputs were written"
    faults = Tally(error_kinds=total.error_kinds).fault_kinds
    check_max_errors(base.max_errors, faults, total.files, "bad files", errors_file, written)
    short = [(name, check) for name, check in combined_checks(scanned) if not check.ok]
    if not short:
        return
    if base.oversubscribe:
        log.warning(
            "oversubscribed the short bucket(s) of %s; repeats recorded in buckets.json",
            ", ".join(repr(name) for name, _ in short),
        )
        return
    raise BatchCheckFailed("\n".join([*(line for name, c in short for line in c.short_lines(name)), ways_out(True)]))
