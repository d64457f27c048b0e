"""The scan across ranks: list on every rank, plan on rank 0, split by bytes, probe with I/O threads on every
rank committing to the journal, write each rank's part of the outputs, and stream the parts
into the outputs on rank 0."""

from __future__ import annotations

import os
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import metadata, storage
from stk.buckets import BucketIndex, BucketSpec, check_batches, effective_batch_size, make_buckets
from stk.cluster.world import World, split_work
from stk.errors import BatchCheckFailed, InputError, check_max_errors, parse_max_errors
from stk.log import get_logger
from stk.progress import Progress
from stk.scan import candidates as cands
from stk.scan.outputs import ERRORS, Filters, Tally, assemble, buckets_document, write_outputs, write_part
from stk.scan.parts import PartWriter, clear_parts
from stk.scan.probe import ProbeOptions, probe
from stk.scan.records import RECORD_SCHEMA, Record, records_to_table
from stk.scan.sidecars import Sidecars, listed_for
from stk.scan.state import Journal, clear_previous, load_previous, save_state
from stk.storage.listing import file_infos, list_sorted

__all__ = ["ScanOptions", "ScanSummary", "bucket_settings", "run_scan", "split_by_bytes"]

log = get_logger("scan")

BLOCK = 65_536  # paths a rank assembles at a time


@dataclass
class Block:
    """A range of paths a rank assembles at once: the candidates to probe and the records reused.

    Sent to its rank as Arrow IPC, its own rows only: a pickled slice of a table carries every
    buffer of the whole table, so each block of a million candidates would carry all of them."""

    todo: pa.Table
    reused: pa.Table

    def __reduce__(self) -> tuple[Any, tuple[pa.Buffer, pa.Buffer]]:
        return _block, (_ipc(self.todo), _ipc(self.reused))


def _ipc(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _block(todo: pa.Buffer, reused: pa.Buffer) -> Block:
    return Block(pa.ipc.open_stream(todo).read_all(), pa.ipc.open_stream(reused).read_all())


Share = list[Block]  # a rank's blocks, in path order


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
    final_checks: bool = True  # --max-errors and the batch check at the end (a dataset of several: checked together)


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


def split_by_bytes(weights: np.ndarray, parts: int, joined: np.ndarray | None = None) -> list[range]:
    """Contiguous runs (path order keeps directories together) of about equal total weight (a
    weight below 1 counts as 1). Where `joined` is true a row stays in the run of the row before
    it (the rows of one path are assembled together)."""
    count = len(weights)
    if not count:
        return [range(0, 0)] * parts
    weights = np.maximum(np.asarray(weights, np.int64), 1)
    before = np.cumsum(weights) - weights
    part = np.minimum(parts - 1, before * parts // int(weights.sum()))
    if joined is not None:
        part = part[np.maximum.accumulate(np.where(joined, 0, np.arange(count)))]
    bounds = np.searchsorted(part, np.arange(parts + 1), side="left")
    return [range(int(bounds[p]), int(bounds[p + 1])) for p in range(parts)]


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


def _list(opts: ScanOptions, listed: list[pa.Table]) -> pa.Table:
    """The candidates; `listed`: the tree's listing where one was made, handed on (popped) so it is
    freed as the candidates are made of it."""
    if opts.source == "-":
        found = cands.from_list(opts.stdin_lines or [])
    elif _is_table(opts.source):
        if not storage.is_s3(opts.source) and not os.path.isfile(opts.source):
            raise InputError(f"{opts.source}: no such table")
        found = cands.from_table(metadata.read_columns(opts.source, opts.columns), source_root(opts))
    else:
        found = cands.from_tree(opts.source, file_infos(listed.pop()) if listed else None, opts.probe.sidecars)
    return cands.settle(found, opts.threads)


def _previous(opts: ScanOptions) -> pa.Table:
    """Records from the last finished scan and from the journal of an interrupted one."""
    if opts.full:
        clear_previous(opts.out_dir)
        return RECORD_SCHEMA.empty_table()
    return load_previous(opts.out_dir, opts.probe.settings_key())


def _reuse(found: pa.Table, previous: pa.Table) -> tuple[np.ndarray, pa.Table]:
    """Which candidates an earlier record still describes (the same fingerprint), and those
    records, in the candidates' order, with today's location (null where the candidate's is)."""
    match = pc.index_in(found.column("path"), value_set=previous.column("path"))
    reuse = np.zeros(found.num_rows, bool)
    start = 0
    for batch in found.to_batches(cands.BATCH):  # fingerprints a batch at a time: not one for every candidate
        stop = start + batch.num_rows
        earlier = previous.column("fingerprint").take(match[start:stop])
        same = pc.fill_null(pc.equal(earlier, cands.fingerprints(batch)), False)
        reuse[start:stop] = pc.and_(same, pc.is_null(batch.column("error_kind"))).to_numpy(zero_copy_only=False)
        start = stop
    rows = match.filter(pa.array(reuse))
    if len(rows) == previous.num_rows and np.array_equal(rows.to_numpy(), np.arange(len(rows))):
        records = previous  # a rerun with nothing changed: the state as it is, not a copy
    else:
        records = previous.take(rows)
    locations = found.column("location") if reuse.all() else found.column("location").filter(pa.array(reuse))
    return reuse, records.set_column(1, "location", locations)


def _shares(found: pa.Table, reuse: np.ndarray, reused: pa.Table, ranks: int) -> list[Share]:
    """Each rank's range of paths, by the bytes it has to read, in blocks of about BLOCK paths."""
    paths = found.column("path")
    joined = np.zeros(len(paths), bool)
    if len(paths) > 1:
        joined[1:] = pc.equal(paths[1:], paths[:-1]).to_numpy(zero_copy_only=False)
    weights = np.where(reuse, 1, found.column("size").to_numpy())
    first_reused = np.cumsum(reuse) - reuse  # where each candidate's reused record would be
    shares: list[Share] = []
    for part in split_by_bytes(weights, ranks, joined):
        blocks = split_by_bytes(np.ones(len(part)), -(-len(part) // BLOCK) or 1, joined[part.start : part.stop])
        share: Share = []
        for block in (range(part.start + b.start, part.start + b.stop) for b in blocks if len(b)):
            todo, mask = found.slice(block.start, len(block)), reuse[block.start : block.stop]
            if mask.any():
                todo = todo.filter(pa.array(~mask))
            share.append(Block(todo, reused.slice(int(first_reused[block.start]), int(mask.sum()))))
        shares.append(share)
    return shares


def _plan(opts: ScanOptions, world: World, listed: list[pa.Table]) -> tuple[list[Share], int, int, str]:
    found = _list(opts, listed)
    previous = _previous(opts)
    if previous.num_rows:
        reuse, reused = _reuse(found, previous)
    else:
        reuse, reused = np.zeros(found.num_rows, bool), RECORD_SCHEMA.empty_table()
    del previous
    clear_parts(opts.out_dir)  # of an interrupted run
    files, todo = found.num_rows, found.num_rows - reused.num_rows
    log.info(
        "%s: %d images listed, %d reused from earlier runs, %d to scan on %d rank(s)",
        opts.source,
        files,
        reused.num_rows,
        todo,
        world.size,
    )
    return _shares(found, reuse, reused, world.size), files, todo, uuid.uuid4().hex[:8]


def _probe_chunk(
    pool: ThreadPoolExecutor, chunk: list[dict[str, Any]], opts: ScanOptions, sidecars: Sidecars
) -> list[Record]:
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
            records[index] = probe(chunk[index], opts.probe, sidecars)

    for worker in [pool.submit(work) for _ in range(min(max(opts.threads, 1), len(chunk)))]:
        worker.result()
    return records


@dataclass
class _RankResult:
    tally: Tally
    parts: dict[str, str]  # output name: this rank's part file


def _probe_share(share: Share, opts: ScanOptions, world: World, run_id: str) -> _RankResult:
    """Probe the rank's blocks, committing every --commit-every files, and write each block's
    part of the outputs."""
    index, filters = BucketIndex(make_buckets(opts.buckets)), _filters(opts)
    journal = Journal(opts.out_dir, run_id, world.rank, opts.probe.settings_key())
    parts = PartWriter(opts.out_dir, run_id, world.rank)
    tally = Tally()
    desc = f"scan (rank 0 of {world.size})"
    with (
        Progress(world, total=sum(block.todo.num_rows for block in share), unit="img", desc=desc) as progress,
        ThreadPoolExecutor(max_workers=max(opts.threads, 1)) as pool,
    ):
        for block in share:
            todo, new = cands.ready(block.todo, opts.source), []
            sidecars = listed_for(todo, pool, opts.probe.sidecars)
            for start in range(0, todo.num_rows, opts.commit_every):
                chunk = todo.slice(start, opts.commit_every).to_pylist()
                records = records_to_table(_probe_chunk(pool, chunk, opts, sidecars))
                journal.commit(records)
                new.append(records)
                progress.update(records.num_rows)
            reused = cands.located(block.reused, opts.source)
            assembled = assemble(pa.concat_tables([reused, *new]), index, filters)  # this run's records win
            write_part(parts, assembled)
            tally = tally.plus(assembled.tally)
    return _RankResult(tally, parts.close())


def _filters(opts: ScanOptions) -> Filters:
    return Filters(opts.min_size, opts.buckets.min_aspect, opts.buckets.max_aspect)


def bucket_settings(opts: ScanOptions) -> dict[str, Any]:
    """The settings buckets.json records: the bucket spec's, the size filter and what makes the effective batch."""
    return {
        **{k: (v.value if hasattr(v, "value") else v) for k, v in asdict(opts.buckets).items()},
        "min_size": opts.min_size,
        "batch_size": opts.batch_size,
        "gpus": opts.gpus,
        "grad_accum": opts.grad_accum,
    }


def _finish(
    opts: ScanOptions, world: World, results: list[_RankResult], files: int, scanned: int, started: float
) -> ScanSummary:
    """On rank 0: add up the ranks' tallies, check the batches, and stream the ranks' parts into
    the outputs and the state."""
    spec = opts.buckets
    buckets = make_buckets(spec)
    effective = effective_batch_size(opts.batch_size, opts.gpus, opts.grad_accum)
    tally = Tally()
    for result in results:
        tally = tally.plus(result.tally)
    parts = {name: [r.parts[name] for r in results if name in r.parts] for name in ("rows", "errors", "state")}
    check = check_batches(tally.counts, buckets, effective, opts.repeats)
    settings = bucket_settings(opts)
    seconds = time.monotonic() - started
    summary = ScanSummary(
        source=opts.source,
        root=source_root(opts),
        out_dir=opts.out_dir,
        files=files,
        images=tally.images,
        errors=tally.faults,
        warnings=tally.warnings,
        skipped=tally.skipped,
        error_kinds=tally.error_kinds,
        warning_kinds=tally.warning_kinds,
        reused=files - scanned,
        scanned=scanned,
        buckets=len(tally.counts),
        effective_batch_size=effective,
        gpus=opts.gpus,
        gpus_from=opts.gpus_from,
        short_buckets=len(check.short),
        ranks=world.size,
        seconds=round(seconds, 3),
        images_per_second=round(scanned / seconds, 1) if seconds > 0 else 0.0,
    )
    doc = buckets_document(tally, check, buckets, settings, opts.oversubscribe)
    write_outputs(opts.out_dir, parts, doc, asdict(summary))
    save_state(opts.out_dir, parts["state"], opts.probe.settings_key())
    clear_parts(opts.out_dir)
    log.info(summary.line())
    if not opts.final_checks:
        return summary
    errors_file, written = os.path.join(opts.out_dir, ERRORS), "the outputs were written"
    check_max_errors(opts.max_errors, tally.fault_kinds, files, "bad files", errors_file, written)
    if not check.ok:
        if opts.oversubscribe:
            log.warning("oversubscribed %d short bucket(s); repeats recorded in buckets.json", len(check.short))
        else:
            raise BatchCheckFailed(check.message())
    return summary


def run_scan(opts: ScanOptions, world: World) -> ScanSummary:
    """Scan on every rank of `world`; every rank returns the summary (the rows are in the scan
    directory, stk.scan.records.json_lines reads them back).

    Every rank lists a part of a tree (stk.storage.listing); planning happens once, on rank 0, so
    the outputs never depend on the rank count; probing, the slow part on a big tree or bucket, is
    spread over the ranks by bytes. Each rank assembles its
    own range of paths into part files, which rank 0 streams into the outputs a row group at a
    time: only counts travel to rank 0, never the rows."""
    started = time.monotonic()
    parse_max_errors(opts.max_errors, 0)  # a bad value fails now, not after the scan
    tree = opts.source != "-" and not _is_table(opts.source)
    listed = [list_sorted(opts.source, world, opts.threads)] if tree else []  # by every rank; the whole on rank 0

    def plan() -> tuple[tuple[int, int, str], list[Share]]:
        os.makedirs(opts.out_dir, exist_ok=True)
        shares, files, scanned, run_id = _plan(opts, world, listed)
        pa.default_memory_pool().release_unused()  # the listing's, freed by now: for the shares' messages
        return (files, scanned, run_id), shares

    def work(shared: tuple[int, int, str], share: Share) -> _RankResult:
        return _probe_share(share, opts, world, shared[2])

    def finish(shared: tuple[int, int, str], results: list[_RankResult]) -> ScanSummary:
        return _finish(opts, world, results, shared[0], shared[1], started)

    return split_work(world, plan, work, finish)
