"""The scan directory of several datasets, made from each dataset's own scan directory: one table with a `dataset`
column, one bucket document whose ids run on from dataset to dataset, one errors.jsonl and one summary.

Each dataset's table is streamed a row group at a time (no rank holds a whole table), its paths made full
locations, since the datasets have roots of their own and the combined table has none."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stk import storage
from stk.buckets import BatchCheck, Bucket, ShortBucket
from stk.datasets import DatasetSpec
from stk.scan.outputs import BUCKETS, ERRORS, METADATA, METADATA_SCHEMA, SUMMARY
from stk.scan.parts import atomic_file
from stk.scan.pipeline import ScanSummary
from stk.storage import name_text

__all__ = ["COMBINED_SCHEMA", "Scanned", "combined_checks", "write_combined"]

COMBINED_SCHEMA = METADATA_SCHEMA.append(pa.field("dataset", pa.string()))
_ROWS = 65_536  # rows streamed at a time
# what each dataset's entry in buckets.json takes from its own buckets.json
_BUCKET_SETTINGS = ("resolution", "resolution_type", "alignment", "min_aspect", "max_aspect", "aspect")


@dataclass
class Scanned:
    """One dataset, scanned into its own directory."""

    spec: DatasetSpec
    out_dir: str
    summary: ScanSummary
    buckets: dict[str, Any]  # its buckets.json

    def checks(self, first_id: int) -> BatchCheck:
        """Its batch check as its scan made it, the bucket ids those of the combined table."""
        sizes = {b["id"]: (b["width"], b["height"]) for b in self.buckets["buckets"]}
        short = [
            ShortBucket(Bucket(first_id + s["id"], *sizes[s["id"]]), s["count"], s["samples"], s["min_repeats"])
            for s in self.buckets["short_buckets"]
        ]
        return BatchCheck(self.buckets["effective_batch_size"], self.buckets["repeats"], short)


def _first_ids(scanned: Sequence[Scanned]) -> list[int]:
    firsts, next_id = [], 0
    for one in scanned:
        firsts.append(next_id)
        next_id += len(one.buckets["buckets"])
    return firsts


def _full_paths(paths: pa.Array, root: str) -> pa.Array:
    """Each path under its dataset's root, unless it names its image in full already (stk.scan.reader.ScanTable)."""
    if not root:
        return paths
    full = pc.or_(pc.starts_with(paths, "/"), pc.match_substring(paths, "://"))
    return pc.if_else(full, paths, pc.binary_join_element_wise(name_text(root).rstrip("/") + "/", paths, ""))


def _rows(one: Scanned, first_id: int) -> Any:
    """Its table's rows as the combined table holds them, a batch at a time."""
    for batch in pq.ParquetFile(os.path.join(one.out_dir, METADATA)).iter_batches(batch_size=_ROWS):
        columns = {name: batch.column(name) for name in METADATA_SCHEMA.names}
        columns["path"] = columns["filename"] = _full_paths(columns["path"], one.summary.root)
        columns["bucket"] = pc.add(columns["bucket"], pa.scalar(first_id, pa.int32()))
        columns["dataset"] = pa.array([one.spec.name] * batch.num_rows, pa.string())
        yield pa.record_batch([columns[name] for name in COMBINED_SCHEMA.names], schema=COMBINED_SCHEMA)


def _dataset_entry(one: Scanned, first_id: int) -> dict[str, Any]:
    doc, spec = one.buckets, one.spec
    return {
        "name": spec.name,
        "source": spec.source,
        "root": one.summary.root,
        "repeats": doc["repeats"],  # its own, else --repeats
        "weight": spec.weight,
        "crop": spec.crop.value if spec.crop else None,
        "caption_dropout": spec.caption_dropout,
        **{key: doc[key] for key in _BUCKET_SETTINGS},
        "min_size": doc["min_size"],
        "images": one.summary.images,
        "buckets": [first_id + b["id"] for b in doc["buckets"]],
    }


def _buckets_document(scanned: Sequence[Scanned], settings: dict[str, Any], oversubscribe: bool) -> dict[str, Any]:
    firsts = _first_ids(scanned)
    short = any(one.buckets["short_buckets"] for one in scanned)
    return {
        **settings,
        "effective_batch_size": scanned[0].buckets["effective_batch_size"],
        "repeats": settings.get("repeats", 1),
        "oversubscribed": bool(oversubscribe and short),
        "batch_check_ok": oversubscribe or not short,
        "weighted": any(one.spec.weight is not None for one in scanned),
        "buckets": [
            {**b, "id": first + b["id"], "dataset": one.spec.name}
            for one, first in zip(scanned, firsts, strict=True)
            for b in one.buckets["buckets"]
        ],
        "short_buckets": [
            {**s, "id": first + s["id"], "dataset": one.spec.name}
            for one, first in zip(scanned, firsts, strict=True)
            for s in one.buckets["short_buckets"]
        ],
        "datasets": [_dataset_entry(one, first) for one, first in zip(scanned, firsts, strict=True)],
    }


def _errors(scanned: Sequence[Scanned], location: str) -> None:
    with atomic_file(location) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for one in scanned:
            with open(os.path.join(one.out_dir, ERRORS), encoding="utf-8") as rows:
                for line in rows:
                    out.write(json.dumps({**json.loads(line), "dataset": one.spec.name}, ensure_ascii=False) + "\n")


def write_combined(
    out_dir: str, scanned: Sequence[Scanned], total: ScanSummary, settings: dict[str, Any], oversubscribe: bool
) -> dict[str, Any]:
    """Write the scan directory of every dataset (metadata.parquet last but one, summary.json last, as a scan of one
    source does) and return its summary: the totals, and each dataset's own."""
    firsts = _first_ids(scanned)
    _errors(scanned, os.path.join(out_dir, ERRORS))
    document = _buckets_document(scanned, settings, oversubscribe)
    storage.write_atomic(os.path.join(out_dir, BUCKETS), (json.dumps(document, indent=1) + "\n").encode())
    location = os.path.join(out_dir, METADATA)
    with atomic_file(location) as tmp, pq.ParquetWriter(tmp, COMBINED_SCHEMA, compression="zstd") as writer:
        for one, first in zip(scanned, firsts, strict=True):
            for batch in _rows(one, first):
                writer.write_batch(batch)
    summary = {**asdict(total), "datasets": [{"name": one.spec.name, **asdict(one.summary)} for one in scanned]}
    storage.write_atomic(os.path.join(out_dir, SUMMARY), (json.dumps(summary, indent=1) + "\n").encode())
    return summary


def combined_checks(scanned: Sequence[Scanned]) -> list[tuple[str, BatchCheck]]:
    """Each dataset's batch check, by name, its bucket ids those of the combined table."""
    return [(one.spec.name, one.checks(first)) for one, first in zip(scanned, _first_ids(scanned), strict=True)]
