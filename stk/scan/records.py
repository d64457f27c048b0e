"""The record a scan keeps for every candidate: an image row, or an error with its reason.

The same schema is used by the resume journal and by the final merge, so records from a killed
run, from the previous table and from this run are interchangeable.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from stk.metadata import to_json_lines
from stk.storage import printable

__all__ = ["JSONL_COLUMNS", "RECORD_SCHEMA", "Record", "error_record", "json_lines", "records_to_table"]

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


# What `stk-scan --jsonl` prints for each image: enough for a shell pipe, without the bookkeeping.
JSONL_COLUMNS = ("path", "width", "height", "caption", "bucket", "bucket_width", "bucket_height", "format", "bytes",
                 "mtime")  # fmt: skip


def json_lines(rows: list[Record]) -> str:
    """The scan's image rows as `stk-scan --jsonl` prints them."""
    return to_json_lines({k: row[k] for k in JSONL_COLUMNS} for row in rows)
