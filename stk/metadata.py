"""Tables in and out: the scan table (parquet or JSONL) and tables made by other trainers."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stk import storage
from stk.errors import InputError

__all__ = ["DEFAULT_ALIASES", "TableRow", "read_parquet", "read_rows", "to_json_lines", "write_parquet"]

# Column names other trainers use, in order of preference, for each field stk reads.
DEFAULT_ALIASES: dict[str, tuple[str, ...]] = {
    "path": ("path", "filename", "file_name", "file", "image", "image_path"),
    "caption": ("caption", "text", "prompt"),
    "width": ("width", "w"),
    "height": ("height", "h"),
}


@dataclass(frozen=True)
class TableRow:
    path: str
    caption: str | None
    width: int | None
    height: int | None


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


def read_rows(location: str, mapping: Mapping[str, str]) -> Iterator[TableRow]:
    """Rows of a .parquet or .jsonl table, with columns mapped to stk's names."""
    data = storage.read_bytes(location)
    if location.endswith(".parquet"):
        try:
            table = pq.read_table(io.BytesIO(data))
        except pa.ArrowException as exc:
            raise InputError(f"{location}: not a readable parquet file ({exc})") from exc
        records: Iterable[dict[str, Any]] = table.to_pylist()
        columns = table.column_names
    else:
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
        columns = sorted({k for r in records for k in r})
    names = _resolve(list(columns), mapping)
    for record in records:
        caption = record.get(names["caption"]) if names["caption"] else None
        yield TableRow(
            path=str(record.get(names["path"]) or ""),  # type: ignore[arg-type]
            caption=None if caption is None else str(caption),
            width=_int_or_none(record.get(names["width"])) if names["width"] else None,
            height=_int_or_none(record.get(names["height"])) if names["height"] else None,
        )


def write_parquet(table: pa.Table, location: str) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    storage.write_atomic(location, buffer.getvalue())


def read_parquet(location: str, columns: list[str] | None = None) -> pa.Table:
    """The table, or those of `columns` it has (a missing one is the caller's to report)."""
    file = pq.ParquetFile(io.BytesIO(storage.read_bytes(location)))
    names = file.schema_arrow.names
    return file.read(columns=[c for c in columns if c in names] if columns is not None else None)


def to_json_lines(rows: Iterable[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(dict(r), ensure_ascii=False, sort_keys=False) + "\n" for r in rows)
