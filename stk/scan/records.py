"""The record a scan keeps for every candidate: an image row, or an error with its reason.

The same schema is used by the resume journal and by the final merge, so records from a killed
run, from the previous table and from this run are interchangeable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stk.metadata import to_json_lines
from stk.storage import printable

__all__ = [
    "JSONL_COLUMNS",
    "RECORD_SCHEMA",
    "Record",
    "by_path",
    "error_record",
    "json_lines",
    "last_per_path",
    "records_to_table",
]

Record = dict[str, Any]

RECORD_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("location", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("format", pa.string()),
        ("bytes", pa.int64()),
        ("mtime", pa.float64()),
        ("etag", pa.string()),
        ("caption", pa.string()),
        ("caption_source", pa.string()),
        ("fingerprint", pa.string()),
        ("kind", pa.string()),  # error kind; null for a good image
        ("reason", pa.string()),
        ("warning_kind", pa.string()),  # damaged metadata on a good image (exif_unreadable)
        ("warning", pa.string()),
    ]
)


def error_record(path: str, location: str, fingerprint: str, kind: str, reason: str) -> Record:
    """`reason` may quote a file name that is not UTF-8: it is kept printable (stk.storage.names)."""
    record: Record = dict.fromkeys(RECORD_SCHEMA.names)
    record.update(path=path, location=location, fingerprint=fingerprint, kind=kind, reason=printable(reason))
    return record


def records_to_table(records: list[Record]) -> pa.Table:
    return pa.Table.from_pylist(records, schema=RECORD_SCHEMA)


def by_path(table: pa.Table) -> pa.Table:
    """Sorted by path, stable: rows of one path keep their order."""
    return table.take(pc.sort_indices(table, sort_keys=[("path", "ascending")]))


def last_per_path(records: pa.Table) -> pa.Table:
    """One record per path, the later one where a path has several, sorted by path. A table that
    is so already (a state file) is returned as it is, not copied."""
    paths = records.column("path")
    if records.num_rows < 2 or pc.all(pc.greater(paths[1:], paths[:-1])).as_py():
        return records
    records = by_path(records)
    paths = records.column("path")
    last = np.ones(records.num_rows, bool)
    if records.num_rows > 1:
        last[:-1] = pc.not_equal(paths[:-1], paths[1:]).to_numpy(zero_copy_only=False)
    return records.filter(pa.array(last))


# What `stk-scan --jsonl` prints for each image: enough for a shell pipe, without the bookkeeping.
JSONL_COLUMNS = (
    "path",
    "width",
    "height",
    "caption",
    "bucket",
    "bucket_width",
    "bucket_height",
    "format",
    "bytes",
    "mtime",
)


def json_lines(table: str) -> Iterator[str]:
    """The rows of the scan table at `table` as `stk-scan --jsonl` prints them, a batch at a time."""
    for batch in pq.ParquetFile(table).iter_batches(batch_size=65_536, columns=list(JSONL_COLUMNS)):
        yield to_json_lines(batch.select(list(JSONL_COLUMNS)).to_pylist())
