"""The scan directory read back: the table with the root its paths are relative to, and the bucket
document. The one reader of what stk/scan/outputs.py writes, for stk-cache and stk-train."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stk import storage
from stk.errors import CacheIncomplete, InputError
from stk.images.preprocess import CropMode
from stk.log import get_logger
from stk.metadata import parquet_file
from stk.scan.outputs import BUCKETS, METADATA, SUMMARY

__all__ = [
    "CROPS",
    "ScanTable",
    "damaged",
    "dataset_rows",
    "open_scan",
    "read_buckets",
    "read_scan",
    "read_scan_columns",
    "row_crops",
    "row_datasets",
]

log = get_logger("scan")

CROPS = tuple(CropMode)  # what row_crops' codes index
# the columns a reader relies on; older scans have them all
_REQUIRED = frozenset({"path", "caption", "bucket_width", "bucket_height", "bytes", "mtime"})


@dataclass
class ScanTable:
    rows: list[dict[str, Any]]
    root: str  # what relative paths are under; "" for a scan made by an older stk-scan from a list

    def image_location(self, path: str) -> str:
        """Where a row's image is: under the root, unless the row names it in full (an absolute path
        or a URL from a list), or the scan has no root. A name stored escaped (not UTF-8) is the
        file's own name again."""
        name = storage.text_name(path)
        if not self.root or os.path.isabs(name) or "://" in name:
            return name
        return storage.join(self.root, name)


def read_scan(scan_dir: str) -> ScanTable:
    """The scan table and the root its paths are relative to, as rows."""
    table, root = read_scan_columns(scan_dir)
    return ScanTable(table.to_pylist(), root)


def open_scan(scan_dir: str, columns: list[str] | None = None) -> tuple[pq.ParquetFile, str]:
    """The scan table opened to be read in parts (its compressed bytes read once and held), and the root its paths are
    relative to. A directory that is no scan is a wrong input (exit 3), and so is a table without the `columns` (or
    all of stk's) that stk needs; a scan file that cannot be read is damage (exit 6), named with its rebuild."""
    table_path = storage.join(scan_dir, METADATA)
    summary = _read_summary(scan_dir)
    if not storage.exists(table_path):
        raise InputError(f"{scan_dir}: no {METADATA} (not an stk-scan output directory; run stk-scan first)")
    try:
        file = parquet_file(table_path)
    except pa.ArrowException as exc:  # pyarrow's I/O errors are ArrowException too; a permission error is not
        raise damaged(table_path, f"not a readable parquet file: {exc}", scan_dir, summary) from None
    root = str(summary.get("root", ""))
    if root and not storage.is_s3(root) and not os.path.isabs(root):
        log.warning(
            "%s records the relative root %r (an older stk-scan): read from the current directory; "
            "rerun stk-scan (it reuses unchanged rows) to record it absolutely",
            storage.join(scan_dir, SUMMARY),
            root,
        )
    missing = (_REQUIRED & set(columns or _REQUIRED)) - set(file.schema_arrow.names)
    if file.metadata.num_rows and missing:
        raise InputError(f"{table_path}: not an stk scan table (missing {sorted(missing)})")
    return file, root


def read_scan_columns(scan_dir: str, columns: list[str] | None = None) -> tuple[pa.Table, str]:
    """The scan table (`columns` of it, or all) as Arrow columns, and the root its paths are relative to (errors as
    open_scan's)."""
    file, root = open_scan(scan_dir, columns)
    names = file.schema_arrow.names
    try:
        return file.read(columns=[c for c in columns if c in names] if columns is not None else None), root
    except pa.ArrowException as exc:
        table_path = storage.join(scan_dir, METADATA)
        raise damaged(table_path, f"not a readable parquet file: {exc}", scan_dir, _read_summary(scan_dir)) from None


def damaged(location: str, why: str, scan_dir: str, summary: dict[str, Any] | None = None) -> CacheIncomplete:
    """The one-line error for a scan file that cannot be read, with the stk-scan command that writes
    it again (a rerun reuses the rows of unchanged files, so it is quick)."""
    source = (summary or {}).get("source") or "SOURCE"
    return CacheIncomplete(
        f"{location} is damaged ({why}): rerun `stk-scan {source} --out {scan_dir}` with the options it was "
        "made with (unchanged files are not read again), then rerun this command"
    )


def _read_summary(scan_dir: str) -> dict[str, Any]:
    """summary.json ({} when absent: an older or interrupted scan); damage names the rebuild."""
    location = storage.join(scan_dir, SUMMARY)
    try:
        summary = json.loads(storage.read_bytes(location))
    except FileNotFoundError:
        return {}
    except NotADirectoryError:
        raise InputError(f"{scan_dir}: not a directory (give the --out directory of stk-scan)") from None
    except ValueError as exc:
        raise damaged(location, f"not JSON: {exc}", scan_dir) from None
    if not isinstance(summary, dict):
        raise damaged(location, "not a JSON object", scan_dir)
    return summary


def read_buckets(scan_dir: str) -> dict[str, Any]:
    """buckets.json: the bucket settings and each bucket's id, size, count and repeats."""
    location = storage.join(scan_dir, BUCKETS)
    try:
        document: dict[str, Any] = json.loads(storage.read_bytes(location))
    except FileNotFoundError:
        raise InputError(f"{scan_dir}: no {BUCKETS} (not an stk-scan output; run stk-scan first)") from None
    except NotADirectoryError:
        raise InputError(f"{scan_dir}: not a directory (give the --out directory of stk-scan)") from None
    except ValueError as exc:
        raise damaged(location, f"not JSON: {exc}", scan_dir, _read_summary(scan_dir)) from None
    if not isinstance(document, dict):
        raise damaged(location, "not a JSON object", scan_dir, _read_summary(scan_dir))
    return document


def row_crops(scan_dir: str, datasets: Iterable[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """Each row's crop in a scan of several datasets (as dataset_rows gives it)."""
    return dataset_rows(scan_dir, datasets)[1]


def dataset_rows(scan_dir: str, datasets: Iterable[pa.Array | pa.ChunkedArray]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's dataset and crop in a scan of several datasets, from its `dataset` column (given a part at a time)
    and buckets.json's "datasets": the dataset's place in that list (int64, row_datasets) and its crop, an index into
    CROPS (int8), -1 where the dataset gives none (the command's --crop). A dataset buckets.json does not list, or a
    crop stk does not know, is damage (they are written together)."""
    location = storage.join(scan_dir, BUCKETS)
    listed = _listed_datasets(scan_dir)
    try:
        crops = np.array([CROPS.index(CropMode(d["crop"])) if d.get("crop") else -1 for d in listed], np.int8)
    except ValueError as exc:
        raise damaged(location, f"a dataset's crop: {exc}", scan_dir) from None
    codes = row_datasets(scan_dir, datasets, listed)
    return codes, crops[codes]


def row_datasets(
    scan_dir: str, datasets: Iterable[pa.Array | pa.ChunkedArray], listed: list[dict[str, Any]] | None = None
) -> np.ndarray:
    """Each row's dataset in a scan of several, from its `dataset` column (given a part at a time): its place in
    buckets.json's "datasets" (`listed`, read when not given), int64. A dataset buckets.json does not list is damage."""
    listed = _listed_datasets(scan_dir) if listed is None else listed
    names, parts = pa.array([d["name"] for d in listed], pa.string()), [np.zeros(0, np.int64)]
    for column in datasets:
        index = pc.index_in(column, value_set=names)
        if index.null_count:
            unknown = pc.filter(column, pc.is_null(index))[0]
            raise damaged(storage.join(scan_dir, METADATA), f"its dataset {unknown} is not in {BUCKETS}", scan_dir)
        parts.append(index.to_numpy(zero_copy_only=False).astype(np.int64))
    return np.concatenate(parts)


def _listed_datasets(scan_dir: str) -> list[dict[str, Any]]:
    """buckets.json's "datasets" list, each a dict with its name (damage otherwise)."""
    listed = read_buckets(scan_dir).get("datasets")
    if not isinstance(listed, list) or not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in listed):
        raise damaged(
            storage.join(scan_dir, BUCKETS),
            'no "datasets" list of named datasets for its table\'s dataset column',
            scan_dir,
        )
    return listed
