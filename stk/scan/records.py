"""The record a scan keeps for every candidate: an image row, or an error with its reason.

The same schema is used by the resume journal and by the final merge, so records from a killed
run, from the previous table and from this run are interchangeable.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

__all__ = ["RECORD_SCHEMA", "Record", "error_record", "records_to_table"]

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
    record: Record = dict.fromkeys(RECORD_SCHEMA.names)
    record.update(path=path, location=location, fingerprint=fingerprint, kind=kind, reason=reason)
    return record


def records_to_table(records: list[Record]) -> pa.Table:
    return pa.Table.from_pylist(records, schema=RECORD_SCHEMA)
