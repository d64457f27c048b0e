"""The scan directory read back: the table with the root its paths are relative to, and the bucket
document. The one reader of what stk/scan/outputs.py writes, for stk-cache and stk-train."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from stk import storage
from stk.errors import InputError
from stk.log import get_logger
from stk.metadata import read_parquet
from stk.scan.outputs import BUCKETS, METADATA, SUMMARY

__all__ = ["ScanTable", "read_buckets", "read_scan"]

log = get_logger("scan")

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
    """The scan table and the root its paths are relative to."""
    table_path = storage.join(scan_dir, METADATA)
    summary_path = storage.join(scan_dir, SUMMARY)
    if not storage.exists(table_path):
        raise InputError(f"{scan_dir}: no {METADATA} (run stk-scan first)")
    rows = read_parquet(table_path).to_pylist()
    root = ""
    if storage.exists(summary_path):
        root = json.loads(storage.read_bytes(summary_path)).get("root", "")
    if root and not storage.is_s3(root) and not os.path.isabs(root):
        log.warning(
            "%s records the relative root %r (an older stk-scan): read from the current directory; "
            "rerun stk-scan (it reuses unchanged rows) to record it absolutely", summary_path, root,
        )  # fmt: skip
    missing = _REQUIRED - set(rows[0] if rows else {})
    if rows and missing:
        raise InputError(f"{table_path}: not an stk scan table (missing {sorted(missing)})")
    return ScanTable(rows, root)


def read_buckets(scan_dir: str) -> dict[str, Any]:
    """buckets.json: the bucket settings and each bucket's id, size, count and repeats."""
    location = storage.join(scan_dir, BUCKETS)
    try:
        document: dict[str, Any] = json.loads(storage.read_bytes(location))
    except FileNotFoundError:
        raise InputError(f"{scan_dir}: no {BUCKETS} (not an stk-scan output; run stk-scan first)") from None
    except ValueError as exc:
        raise InputError(f"{location}: not an stk-scan {BUCKETS} ({exc})") from exc
    return document
