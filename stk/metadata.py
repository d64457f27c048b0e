"""Tables in and out: the scan table (parquet or JSONL) and tables made by other trainers."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stk import storage
from stk.errors import InputError

__all__ = ["DEFAULT_ALIASES", "parquet_file", "read_columns", "to_json_lines", "write_parquet"]

# Column names other trainers use, in order of preference, for each field stk reads.
DEFAULT_ALIASES: dict[str, tuple[str, ...]] = {
    "path": ("path", "filename", "file_name", "file", "image", "image_path"),
    "caption": ("caption", "text", "prompt"),
    "width": ("width", "w"),
    "height": ("height", "h"),
}


def _resolve(columns: list[str], mapping: Mapping[str, str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for field, aliases in DEFAULT_ALIASES.items():
        if field in mapping:
            if mapping[field] not in columns:
                raise InputError(
                    f"--column {field}={mapping[field]}: the table has no column {mapping[field]!r} (it has {columns})"
                )
            found[field] = mapping[field]
        else:
            found[field] = next((a for a in aliases if a in columns), None)
    if found["path"] is None:
        raise InputError(f"the table has no path column (looked for {DEFAULT_ALIASES['path']}; use --column path=NAME)")
    return found


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except (TypeError, ValueError):
        return None


def _sizes(column: pa.ChunkedArray) -> pa.Array:
    """A width or height column as int32, null where not a positive number: by Arrow for numbers
    (a table of a million rows is not turned into Python objects), else value by value."""
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = column.to_numpy(zero_copy_only=False).astype("float64")  # nulls become NaN
        with np.errstate(invalid="ignore"):
            whole = np.trunc(values)
            good = np.isfinite(whole) & (whole > 0) & (whole < 2**31)
        return pa.array(np.where(good, whole, 0).astype("int32"), mask=~good)
    return pa.array([_int_or_none(v) for v in column.to_pylist()], pa.int32())


def _texts(column: pa.ChunkedArray, empty: str | None) -> pa.Array:
    """A path or caption column as strings; a null is `empty` (None: stays null)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        strings = column.combine_chunks().cast(pa.string())
        return strings if empty is None else pc.fill_null(strings, empty)
    if empty is None:
        return pa.array([None if v is None else str(v) for v in column.to_pylist()], pa.string())
    return pa.array([str(v or empty) for v in column.to_pylist()], pa.string())


def _jsonl_records(location: str, data: bytes) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{location}:{number}: not a JSON object ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise InputError(f"{location}:{number}: not a JSON object")
        records.append(record)
    return records


_TEXT_OF = {"path": lambda v: str(v or ""), "caption": lambda v: None if v is None else str(v)}


def _jsonl_columns(location: str, data: bytes, mapping: Mapping[str, str]) -> dict[str, pa.Array]:
    records = _jsonl_records(location, data)
    names = _resolve(sorted({k for r in records for k in r}), mapping)
    out = {}
    for field, name in names.items():
        if name is None:
            out[field] = pa.nulls(len(records), pa.string() if field in _TEXT_OF else pa.int32())
        elif field in _TEXT_OF:
            out[field] = pa.array([_TEXT_OF[field](r.get(name)) for r in records], pa.string())
        else:
            out[field] = pa.array([_int_or_none(r.get(name)) for r in records], pa.int32())
    return out


def _parquet_columns(location: str, data: bytes, mapping: Mapping[str, str]) -> dict[str, pa.Array]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except pa.ArrowException as exc:
        raise InputError(f"{location}: not a readable parquet file ({exc})") from exc
    names = _resolve(table.column_names, mapping)
    out = {}
    for field, name in names.items():
        if name is None:
            out[field] = pa.nulls(table.num_rows, pa.string() if field in _TEXT_OF else pa.int32())
        elif field in _TEXT_OF:
            out[field] = _texts(table.column(name), "" if field == "path" else None)
        else:
            out[field] = _sizes(table.column(name))
    return out


def read_columns(location: str, mapping: Mapping[str, str]) -> pa.Table:
    """A .parquet or .jsonl table as the columns path (string, never null), caption (string),
    width and height (int32, null unless positive), with columns mapped to stk's names."""
    data = storage.read_bytes(location)
    read = _parquet_columns if location.endswith(".parquet") else _jsonl_columns
    return pa.table(read(location, data, mapping))


def write_parquet(table: pa.Table, location: str) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    storage.write_atomic(location, buffer.getvalue())


def parquet_file(location: str) -> pq.ParquetFile:
    """A parquet file to read in parts (row groups, batches, some columns): its compressed bytes are held, not its
    decoded table."""
    return pq.ParquetFile(io.BytesIO(storage.read_bytes(location)))


def to_json_lines(rows: Iterable[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(dict(r), ensure_ascii=False, sort_keys=False) + "\n" for r in rows)
