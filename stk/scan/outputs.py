"""From all records to the scan directory: metadata.parquet, buckets.json, errors.jsonl."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from stk import storage
from stk.buckets import BatchCheck, Bucket, BucketIndex, check_batches
from stk.metadata import to_json_lines, write_parquet
from stk.scan.records import Record

__all__ = ["BUCKETS", "ERRORS", "METADATA", "SUMMARY", "Assembled", "Filters", "assemble", "write_outputs"]

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


@dataclass
class Assembled:
    rows: list[Record]
    errors: list[Record]
    counts: dict[int, int]
    check: BatchCheck
    error_kinds: dict[str, int] = field(default_factory=dict)
    warning_kinds: dict[str, int] = field(default_factory=dict)  # on images that were kept
    latest: list[Record] = field(default_factory=list)  # one record per path, as probed (for reuse)

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


def _filter_reason(rec: Record, filters: Filters) -> tuple[str, str] | None:
    width, height = rec["width"], rec["height"]
    if min(width, height) < filters.min_size:
        return "too_small", f"{width}x{height}: shorter side below --min-size {filters.min_size}"
    aspect = width / height
    if not filters.min_aspect - 1e-9 <= aspect <= filters.max_aspect + 1e-9:
        return (
            "aspect_out_of_range",
            f"{width}x{height}: aspect {aspect:.3f} outside [{filters.min_aspect}, {filters.max_aspect}]",
        )
    return None


def _error_row(rec: Record) -> Record:
    """What errors.jsonl keeps of a failed or skipped record: the image is not in the table."""
    return {**{k: rec[k] for k in ("path", "location", "kind", "reason")}, "severity": "error"}


def _warning_row(rec: Record) -> Record:
    """What errors.jsonl keeps of an image kept in the table despite damaged metadata."""
    return {"path": rec["path"], "location": rec["location"], "kind": rec["warning_kind"], "reason": rec["warning"],
            "severity": "warning"}  # fmt: skip


def assemble(records: list[Record], buckets: list[Bucket], filters: Filters, effective: int, repeats: int) -> Assembled:
    """Sort by path, keep one record per path, filter, assign buckets and check batches.

    Pure: the same records give the same result whatever number of ranks produced them."""
    by_path: dict[str, Record] = {}
    relisted: list[Record] = []
    for rec in records:
        if rec["kind"] == "duplicate":
            relisted.append(rec)  # a path listed again: reported, never replacing the path's own record
        else:
            by_path[rec["path"]] = rec  # later records (this run) win over earlier ones
    index = BucketIndex(buckets)
    rows: list[Record] = []
    errors: list[Record] = []
    warnings: list[Record] = []
    for path in sorted(by_path):
        rec = dict(by_path[path])
        if rec["kind"] is None:
            skip = _filter_reason(rec, filters)
            if skip is not None:
                rec["kind"], rec["reason"] = skip
        if rec["kind"] is not None:
            errors.append(_error_row(rec))
            continue
        bucket = index.nearest(rec["width"], rec["height"])
        rec.update(filename=path, bucket=bucket.id, bucket_width=bucket.width, bucket_height=bucket.height)
        rows.append(rec)
        if rec["warning_kind"] is not None:
            warnings.append(_warning_row(rec))
    errors.extend(_error_row(rec) for rec in relisted)
    kinds = Counter(e["kind"] for e in errors)
    warning_kinds = Counter(w["kind"] for w in warnings)
    errors.extend(warnings)
    errors.sort(key=lambda e: e["path"])  # stable: a path's own error stays before its repeats
    counts = Counter(r["bucket"] for r in rows)
    check = check_batches(dict(counts), buckets, effective, repeats)
    latest = [by_path[path] for path in sorted(by_path)]
    return Assembled(
        rows, errors, dict(counts), check, dict(sorted(kinds.items())), dict(sorted(warning_kinds.items())), latest
    )


def buckets_document(
    assembled: Assembled, buckets: list[Bucket], settings: dict[str, Any], oversubscribe: bool
) -> dict[str, Any]:
    check = assembled.check
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
                "count": assembled.counts.get(b.id, 0),
                "repeats": check.repeats_for(b.id, oversubscribe),
            }
            for b in buckets
        ],
        "short_buckets": [
            {"id": s.bucket.id, "count": s.count, "samples": s.samples, "min_repeats": s.min_repeats}
            for s in check.short
        ],
    }


def write_outputs(out_dir: str, assembled: Assembled, buckets_doc: dict[str, Any], summary: dict[str, Any]) -> None:
    """Each file atomically; metadata.parquet last but one, summary.json last."""
    storage.write_atomic(os.path.join(out_dir, ERRORS), to_json_lines(assembled.errors).encode())
    storage.write_atomic(os.path.join(out_dir, BUCKETS), (json.dumps(buckets_doc, indent=1) + "\n").encode())
    table = pa.Table.from_pylist(assembled.rows, schema=METADATA_SCHEMA)
    write_parquet(table, os.path.join(out_dir, METADATA))
    storage.write_atomic(os.path.join(out_dir, SUMMARY), (json.dumps(summary, indent=1) + "\n").encode())
