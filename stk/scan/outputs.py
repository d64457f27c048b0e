"""From records to the scan directory: metadata.parquet, buckets.json, errors.jsonl, a range of
paths at a time."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.buckets import BatchCheck, Bucket, BucketIndex
from stk.scan.parts import PartWriter, stream_jsonl, stream_parquet
from stk.scan.records import by_path, last_per_path

__all__ = [
    "BUCKETS",
    "ERRORS",
    "METADATA",
    "SUMMARY",
    "Assembled",
    "Filters",
    "Tally",
    "assemble",
    "write_outputs",
    "write_part",
]

METADATA, BUCKETS, ERRORS, SUMMARY = "metadata.parquet", "buckets.json", "errors.jsonl", "summary.json"

# Filters, not faults: listed in errors.jsonl, counted as skipped, not held against --max-errors.
SKIP_KINDS = frozenset({"too_small", "aspect_out_of_range"})

METADATA_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("filename", pa.string()),  # the same as path: the column other trainers read
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("caption", pa.string()),
        ("bucket", pa.int32()),
        ("bucket_width", pa.int32()),
        ("bucket_height", pa.int32()),
        ("format", pa.string()),
        ("bytes", pa.int64()),
        ("mtime", pa.float64()),
        ("etag", pa.string()),
        ("caption_source", pa.string()),
        ("fingerprint", pa.string()),
    ]
)


@dataclass(frozen=True)
class Filters:
    min_size: int = 0  # shorter side, pixels
    min_aspect: float = 0.5
    max_aspect: float = 2.0


ERROR_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("location", pa.string()),
        ("kind", pa.string()),
        ("reason", pa.string()),
        ("severity", pa.string()),
    ]  # error: the image is not in the table; warning: kept, metadata damaged
)


@dataclass
class Tally:
    """What the table holds, counted: small whatever the number of images, so ranks add theirs up."""

    counts: dict[int, int] = field(default_factory=dict)  # images per bucket id
    error_kinds: dict[str, int] = field(default_factory=dict)
    warning_kinds: dict[str, int] = field(default_factory=dict)  # on images that were kept

    def plus(self, other: Tally) -> Tally:
        def add(a: dict[Any, int], b: dict[Any, int]) -> dict[Any, int]:
            return dict(sorted((Counter(a) + Counter(b)).items()))

        return Tally(
            add(self.counts, other.counts),
            add(self.error_kinds, other.error_kinds),
            add(self.warning_kinds, other.warning_kinds),
        )

    @property
    def images(self) -> int:
        return sum(self.counts.values())

    @property
    def fault_kinds(self) -> dict[str, int]:
        """Bad files by kind: what --max-errors counts."""
        return {kind: n for kind, n in self.error_kinds.items() if kind not in SKIP_KINDS}

    @property
    def faults(self) -> int:
        return sum(self.fault_kinds.values())

    @property
    def warnings(self) -> int:
        return sum(self.warning_kinds.values())

    @property
    def skipped(self) -> int:
        return sum(n for kind, n in self.error_kinds.items() if kind in SKIP_KINDS)


@dataclass
class Assembled:
    """One range of paths, assembled: its table rows (records with their buckets), its errors.jsonl
    rows, and one record per path as probed (the state a rerun reuses)."""

    rows: pa.Table
    errors: pa.Table
    latest: pa.Table
    tally: Tally


def _filter_reason(width: int, height: int, filters: Filters) -> tuple[str, str] | None:
    if min(width, height) < filters.min_size:
        return "too_small", f"{width}x{height}: shorter side below --min-size {filters.min_size}"
    aspect = width / height
    if not filters.min_aspect - 1e-9 <= aspect <= filters.max_aspect + 1e-9:
        return (
            "aspect_out_of_range",
            f"{width}x{height}: aspect {aspect:.3f} outside [{filters.min_aspect}, {filters.max_aspect}]",
        )
    return None


def _judged(records: pa.Table, filters: Filters) -> pa.Table:
    """The records with the filters' verdicts as error kinds: too small, or too narrow or wide."""
    good = pc.is_null(records.column("kind")).to_numpy(zero_copy_only=False)
    widths = pc.fill_null(records.column("width"), 1).to_numpy(zero_copy_only=False).astype(np.int64)
    heights = pc.fill_null(records.column("height"), 1).to_numpy(zero_copy_only=False).astype(np.int64)
    aspects = widths / heights
    inside = (filters.min_aspect - 1e-9 <= aspects) & (aspects <= filters.max_aspect + 1e-9)
    flagged = np.flatnonzero(good & ((np.minimum(widths, heights) < filters.min_size) | ~inside))
    if not len(flagged):
        return records
    kinds = records.column("kind").to_numpy(zero_copy_only=False).copy()
    reasons = records.column("reason").to_numpy(zero_copy_only=False).copy()
    for i in flagged:  # the numbers say which; the reason is written once, here
        verdict = _filter_reason(int(widths[i]), int(heights[i]), filters)
        if verdict is not None:
            kinds[i], reasons[i] = verdict
    judged = records.set_column(records.schema.get_field_index("kind"), "kind", pa.array(kinds, pa.string()))
    return judged.set_column(judged.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))


def _report(records: pa.Table, kind: str, reason: str, severity: str) -> pa.Table:
    columns = [
        records.column("path"),
        records.column("location"),
        records.column(kind),
        records.column(reason),
        pa.array([severity] * records.num_rows, pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=ERROR_SCHEMA)


def _with_buckets(kept: pa.Table, index: BucketIndex) -> pa.Table:
    """The kept records with the table's own columns: the nearest bucket, looked up once per distinct
    size."""
    widths = kept.column("width").to_numpy(zero_copy_only=False).astype(np.int64)
    heights = kept.column("height").to_numpy(zero_copy_only=False).astype(np.int64)
    sizes, which = np.unique((widths << 32) | heights, return_inverse=True)
    nearest = [index.nearest(int(size >> 32), int(size & 0xFFFFFFFF)) for size in sizes]
    columns = {"filename": kept.column("path")}
    for name in ("id", "width", "height"):
        values = np.array([getattr(b, name) for b in nearest], np.int32)[which.reshape(-1)]
        columns["bucket" if name == "id" else f"bucket_{name}"] = pa.array(values, pa.int32())
    for name in ("filename", "bucket", "bucket_width", "bucket_height"):
        kept = kept.append_column(pa.field(name, METADATA_SCHEMA.field(name).type), columns[name])
    return kept


def _kinds(column: pa.ChunkedArray | pa.Array) -> dict[str, int]:
    return {str(v["values"]): int(v["counts"]) for v in pc.value_counts(column).to_pylist()}


def assemble(records: pa.Table, index: BucketIndex, filters: Filters) -> Assembled:
    """Sort by path, keep one record per path, filter and assign buckets.

    Pure: the same records give the same result whatever number of ranks produced them, and a
    range of paths gives the part of the whole that it covers."""
    relisted_mask = pc.fill_null(pc.equal(records.column("kind"), "duplicate"), False)
    relisted = records.filter(relisted_mask)  # a path listed again: reported, never replacing its own record
    latest = last_per_path(records.filter(pc.invert(relisted_mask)))  # later records (this run) win
    judged = _judged(latest, filters)
    bad = pc.is_valid(judged.column("kind"))
    failed, kept = judged.filter(bad), judged.filter(pc.invert(bad))
    warned = kept.filter(pc.is_valid(kept.column("warning_kind")))
    errors = pa.concat_tables(
        [
            _report(failed, "kind", "reason", "error"),
            _report(relisted, "kind", "reason", "error"),
            _report(warned, "warning_kind", "warning", "warning"),
        ]
    )
    rows = _with_buckets(kept, index)
    bucket_ids, counts = np.unique(rows.column("bucket").to_numpy(zero_copy_only=False), return_counts=True)
    tally = Tally(
        {int(b): int(n) for b, n in zip(bucket_ids, counts, strict=True)},
        dict(sorted((Counter(_kinds(failed.column("kind"))) + Counter(_kinds(relisted.column("kind")))).items())),
        dict(sorted(_kinds(warned.column("warning_kind")).items())),
    )
    return Assembled(rows, by_path(errors), latest, tally)  # a path's own error stays before its repeats


def buckets_document(
    tally: Tally, check: BatchCheck, buckets: list[Bucket], settings: dict[str, Any], oversubscribe: bool
) -> dict[str, Any]:
    return {
        **settings,
        "effective_batch_size": check.effective_batch_size,
        "repeats": check.repeats,
        "oversubscribed": bool(oversubscribe and check.short),
        "batch_check_ok": check.ok or oversubscribe,
        "buckets": [
            {
                "id": b.id,
                "width": b.width,
                "height": b.height,
                "count": tally.counts.get(b.id, 0),
                "repeats": check.repeats_for(b.id, oversubscribe),
            }
            for b in buckets
        ],
        "short_buckets": [
            {"id": s.bucket.id, "count": s.count, "samples": s.samples, "min_repeats": s.min_repeats}
            for s in check.short
        ],
    }


def write_part(parts: PartWriter, assembled: Assembled) -> None:
    """A range's rows, errors and state, after those of the ranges before it."""
    parts.write("rows", assembled.rows.select(METADATA_SCHEMA.names).cast(METADATA_SCHEMA))
    parts.write("errors", assembled.errors)
    parts.write("state", assembled.latest)


def write_outputs(
    out_dir: str, parts: dict[str, list[str]], buckets_doc: dict[str, Any], summary: dict[str, Any]
) -> None:
    """Each file atomically, the ranks' parts streamed in path order; metadata.parquet last but one,
    summary.json last."""
    stream_jsonl(parts.get("errors", []), os.path.join(out_dir, ERRORS))
    storage.write_atomic(os.path.join(out_dir, BUCKETS), (json.dumps(buckets_doc, indent=1) + "\n").encode())
    stream_parquet(parts.get("rows", []), os.path.join(out_dir, METADATA), METADATA_SCHEMA)
    storage.write_atomic(os.path.join(out_dir, SUMMARY), (json.dumps(summary, indent=1) + "\n").encode())
