"""The scan across ranks: list on rank 0, split by bytes, probe with I/O threads on every
rank committing to the journal, gather, and write the outputs on rank 0."""

from __future__ import annotations

import os
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from stk import metadata, storage
from stk.buckets import BucketSpec, effective_batch_size, make_buckets
from stk.errors import BatchCheckFailed, InputError, check_max_errors, parse_max_errors
from stk.log import get_logger
from stk.progress import Progress
from stk.scan import candidates as cands
from stk.scan.outputs import ERRORS, Filters, assemble, buckets_document, write_outputs
from stk.scan.probe import ProbeOptions, probe
from stk.scan.records import Record
from stk.scan.state import Journal, clear_previous, load_previous, save_state
from stk.world import World, split_work

__all__ = ["ScanOptions", "ScanSummary", "run_scan", "split_by_bytes"]

log = get_logger("scan")


@dataclass
class ScanOptions:
    source: str  # directory, s3://bucket/prefix, a .parquet/.jsonl table, or "-"
    out_dir: str
    stdin_lines: list[str] | None = None  # the list read from stdin (rank 0) when source is "-"
    table_root: str | None = None  # root of a table's relative paths (default: the table's folder)
    columns: dict[str, str] = field(default_factory=dict)
    full: bool = False
    threads: int = 8
    commit_every: int = 2000
    probe: ProbeOptions = field(default_factory=ProbeOptions)
    buckets: BucketSpec = field(default_factory=BucketSpec)
    min_size: int = 0
    batch_size: int = 1
    gpus: int = 1
    gpus_from: str = "default"  # where `gpus` came from: option | slurm | nvml | default
    grad_accum: int = 1
    repeats: int = 1
    oversubscribe: bool = False
    max_errors: str = "1%"


@dataclass
class ScanSummary:
    source: str
    root: str  # absolute; image location = root + "/" + path (stk.scan.reader.ScanTable.image_location)
    out_dir: str
    files: int
    images: int
    errors: int
    warnings: int  # images kept despite damaged metadata (errors.jsonl rows with severity warning)
    skipped: int
    error_kinds: dict[str, int]
    warning_kinds: dict[str, int]
    reused: int
    scanned: int
    buckets: int
    effective_batch_size: int
    gpus: int
    gpus_from: str
    short_buckets: int
    ranks: int
    seconds: float
    images_per_second: float

    def line(self) -> str:
        return (
            f"{self.files} files: {self.images} images, {self.errors} errors, {self.warnings} warnings, "
            f"{self.skipped} skipped, "
            f"{self.buckets} buckets used; {self.scanned} scanned + {self.reused} reused in {self.seconds:.1f} s "
            f"({self.images_per_second:.0f}/s on {self.ranks} rank(s))"
        )


def split_by_bytes(items: list[cands.Candidate], parts: int) -> list[list[cands.Candidate]]:
    """Contiguous runs (path order keeps directories together) of about equal total bytes."""
    weights = [max(c.size, 1) for c in items]
    total = sum(weights)
    out: list[list[cands.Candidate]] = [[] for _ in range(parts)]
    running = 0
    for cand, weight in zip(items, weights, strict=True):
        part = min(parts - 1, running * parts // total) if total else 0
        out[part].append(cand)
        running += weight
    return out


def _is_table(source: str) -> bool:
    return source.endswith((".parquet", ".jsonl"))


def source_root(opts: ScanOptions) -> str:
    """What the table's paths are relative to: the tree, the table's root, or (for a list) the
    directory its relative paths were given in. Absolute, so that the scan can be used from any
    working directory (stk-cache and stk-train run wherever their job starts)."""
    if opts.source == "-":
        root = ""
    elif _is_table(opts.source):
        root = opts.table_root if opts.table_root is not None else os.path.dirname(opts.source)
    else:
        root = opts.source
    return root if storage.is_s3(root) else os.path.abspath(root)


def _list(opts: ScanOptions) -> list[cands.Candidate]:
    if opts.source == "-":
        found = cands.from_list(opts.stdin_lines or [])
    elif _is_table(opts.source):
        if not storage.is_s3(opts.source) and not os.path.isfile(opts.source):
            raise InputError(f"{opts.source}: no such table")
        found = cands.from_table(metadata.read_rows(opts.source, opts.columns), source_root(opts))
    else:
        found = cands.from_tree(opts.source)
    cands.stat_unknown(found, opts.threads)
    return found


def _previous(opts: ScanOptions) -> dict[str, Record]:
    """Records from the last finished scan and from the journal of an interrupted one."""
    if opts.full:
        clear_previous(opts.out_dir)
        return {}
    return {r["path"]: r for r in load_previous(opts.out_dir, opts.probe.settings_key())}


def _plan(opts: ScanOptions, world: World) -> tuple[list[list[cands.Candidate]], list[Record], int, str]:
    found = _list(opts)
    previous = _previous(opts)
    reused: list[Record] = []
    todo: list[cands.Candidate] = []
    for cand in found:
        old = previous.get(cand.path)
        if old is not None and old["fingerprint"] == cand.fingerprint and cand.error_kind is None:
            reused.append({**old, "location": cand.shown_location})  # state records have the record schema
        else:
            todo.append(cand)
    log.info(
        "%s: %d images listed, %d reused from earlier runs, %d to scan on %d rank(s)",
        opts.source,
        len(found),
        len(reused),
        len(todo),
        world.size,
    )
    return split_by_bytes(todo, world.size), reused, len(found), uuid.uuid4().hex[:8]


def _probe_chunk(pool: ThreadPoolExecutor, chunk: list[cands.Candidate], opts: ScanOptions) -> list[Record]:
    """The records of `chunk`, in its order, each thread pulling the next file from a shared
    queue: a pool task per file costs more in futures and thread wake-ups than probing a header
    in the page cache does, and fixed batches would leave threads idle on slow storage."""
    records: list[Record] = [{}] * len(chunk)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(chunk)):
        todo.put(index)

    def work() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            records[index] = probe(chunk[index], opts.probe)

    for worker in [pool.submit(work) for _ in range(min(max(opts.threads, 1), len(chunk)))]:
        worker.result()
    return records


def _probe_share(
    share: list[cands.Candidate], opts: ScanOptions, world: World, run_id: str, total: int
) -> list[Record]:
    journal = Journal(opts.out_dir, run_id, world.rank, opts.probe.settings_key())
    results: list[Record] = []
    desc = f"scan (rank 0 of {world.size})"
    with (
        Progress(world, total=len(share), unit="img", desc=desc) as progress,
        ThreadPoolExecutor(max_workers=max(opts.threads, 1)) as pool,
    ):
        for start in range(0, len(share), opts.commit_every):
            records = _probe_chunk(pool, share[start : start + opts.commit_every], opts)
            journal.commit(records)
            results.extend(records)
            progress.update(len(records))
    return results


def _finish(
    opts: ScanOptions, world: World, records: list[Record], files: int, scanned: int, started: float
) -> tuple[ScanSummary, list[Record]]:
    spec = opts.buckets
    buckets = make_buckets(spec)
    effective = effective_batch_size(opts.batch_size, opts.gpus, opts.grad_accum)
    filters = Filters(opts.min_size, spec.min_aspect, spec.max_aspect)
    assembled = assemble(records, buckets, filters, effective, opts.repeats)
    settings: dict[str, Any] = {
        **{k: (v.value if hasattr(v, "value") else v) for k, v in asdict(spec).items()},
        "min_size": opts.min_size,
        "batch_size": opts.batch_size,
        "gpus": opts.gpus,
        "grad_accum": opts.grad_accum,
    }
    seconds = time.monotonic() - started
    summary = ScanSummary(
        source=opts.source,
        root=source_root(opts),
        out_dir=opts.out_dir,
        files=files,
        images=len(assembled.rows),
        errors=assembled.faults,
        warnings=assembled.warnings,
        skipped=assembled.skipped,
        error_kinds=assembled.error_kinds,
        warning_kinds=assembled.warning_kinds,
        reused=files - scanned,
        scanned=scanned,
        buckets=len(assembled.counts),
        effective_batch_size=effective,
        gpus=opts.gpus,
        gpus_from=opts.gpus_from,
        short_buckets=len(assembled.check.short),
        ranks=world.size,
        seconds=round(seconds, 3),
        images_per_second=round(scanned / seconds, 1) if seconds > 0 else 0.0,
    )
    doc = buckets_document(assembled, buckets, settings, opts.oversubscribe)
    write_outputs(opts.out_dir, assembled, doc, asdict(summary))
    save_state(opts.out_dir, assembled.latest, opts.probe.settings_key())
    log.info(summary.line())
    errors_file, written = os.path.join(opts.out_dir, ERRORS), "the outputs were written"
    check_max_errors(opts.max_errors, assembled.fault_kinds, files, "bad files", errors_file, written)
    if not assembled.check.ok:
        if opts.oversubscribe:
            log.warning(
                "oversubscribed %d short bucket(s); repeats recorded in buckets.json", len(assembled.check.short)
            )
        else:
            raise BatchCheckFailed(assembled.check.message())
    return summary, assembled.rows


def run_scan(opts: ScanOptions, world: World) -> tuple[ScanSummary, list[Record]]:
    """Scan on every rank of `world`; every rank returns the summary, rank 0 also the rows.

    Listing and writing happen once, on rank 0, so the outputs never depend on the rank count;
    probing, the slow part on a big tree or bucket, is spread over the ranks by bytes. Large data
    moves only where it must: each rank receives its own share and sends its records to rank 0."""
    started = time.monotonic()
    parse_max_errors(opts.max_errors, 0)  # a bad value fails now, not after the scan
    reused: list[Record] = []
    rows: list[Record] = []

    def plan() -> tuple[tuple[int, str], list[list[cands.Candidate]]]:
        os.makedirs(opts.out_dir, exist_ok=True)
        shares, found_before, files, run_id = _plan(opts, world)
        reused.extend(found_before)
        return (files, run_id), shares

    def work(shared: tuple[int, str], share: list[cands.Candidate]) -> list[Record]:
        files, run_id = shared
        return _probe_share(share, opts, world, run_id, files)

    def finish(shared: tuple[int, str], parts: list[list[Record]]) -> ScanSummary:
        new = [r for part in parts for r in part]
        summary, written = _finish(opts, world, reused + new, shared[0], len(new), started)
        rows.extend(written)
        return summary

    return split_work(world, plan, work, finish), rows
