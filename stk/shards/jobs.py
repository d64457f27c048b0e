"""What a scan asks of a cache: one ImageJob per scan row, keyed under a cache config's recipes, and the rows a
cache must hold (those the last build did not skip as bad input). stk-cache encodes the jobs; stk-cache verify
and stk-train check a cache covers them. Nothing here loads a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from stk import storage
from stk.scan.reader import ScanTable, read_scan_columns
from stk.shards.config import CacheConfig
from stk.shards.keys import KEY_CHARS, latent_keys, text_key

__all__ = [
    "ERRORS",
    "JOB_COLUMNS",
    "ImageJob",
    "ImageJobs",
    "expected_columns",
    "expected_jobs",
    "job_columns",
    "jobs_for",
    "read_jobs",
]

ERRORS = "errors.jsonl"  # CACHE/errors.jsonl: the records the last build could not encode
# errors.jsonl kinds that a rerun would meet again: their records are reported, not expected
BAD_INPUT = frozenset({"decode_failed", "nonfinite_latent", "nonfinite_embedding"})


@dataclass(frozen=True)
class ImageJob:
    path: str
    location: str
    bucket_width: int
    bucket_height: int
    caption: str
    key: str
    text_key: str

    @property
    def pixels(self) -> int:
        return self.bucket_width * self.bucket_height


# the scan table's columns a job needs
JOB_COLUMNS = ["path", "caption", "bucket_width", "bucket_height", "bytes", "mtime"]
_KEY_CHUNK = 65_536  # rows keyed at a time: their Python values live only that long


@dataclass
class ImageJobs:
    """The scan rows as columns, keyed: what stk-cache plans with, a few hundred bytes a row and no Python
    object per row. `rows()` makes ImageJobs for the few rows a batch needs."""

    root: str  # the scan's, that relative paths are under (ScanTable.image_location)
    path: pa.ChunkedArray  # strings, as read
    caption: pa.ChunkedArray  # strings, as read: null where the table has none
    bucket_width: np.ndarray  # int32
    bucket_height: np.ndarray  # int32
    key: np.ndarray  # latent keys, bytes (S40)
    text_key: np.ndarray  # each row's caption's text key, bytes (S40)

    def __len__(self) -> int:
        return len(self.key)

    @property
    def pixels(self) -> np.ndarray:
        return self.bucket_width.astype(np.int64) * self.bucket_height

    def take(self, rows: np.ndarray) -> ImageJobs:
        """These rows, in this order."""
        index = pa.array(rows, pa.int64())
        return ImageJobs(
            self.root, self.path.take(index), self.caption.take(index), self.bucket_width[rows],
            self.bucket_height[rows], self.key[rows], self.text_key[rows],
        )  # fmt: skip

    def rows(self, start: int = 0, stop: int | None = None) -> list[ImageJob]:
        """Rows [start, stop) as ImageJobs."""
        stop = len(self) if stop is None else stop
        scan = ScanTable([], self.root)
        paths, captions = self.path[start:stop].to_pylist(), self.caption[start:stop].to_pylist()
        return [
            ImageJob(path, scan.image_location(path), int(w), int(h), caption or "", key.decode(), text.decode())
            for path, caption, w, h, key, text in zip(
                paths, captions, self.bucket_width[start:stop], self.bucket_height[start:stop],
                self.key[start:stop], self.text_key[start:stop], strict=True,
            )
        ]  # fmt: skip


def job_columns(table: pa.Table, root: str, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]) -> ImageJobs:
    """A scan table's rows (JOB_COLUMNS of it) keyed under the given recipes; each distinct caption is keyed once."""
    path, caption = table.column("path"), table.column("caption")  # the table's chunks: no copy
    key = np.empty(table.num_rows, dtype=f"S{KEY_CHARS}")
    text = np.empty(table.num_rows, dtype=f"S{KEY_CHARS}")
    identity = ["path", "bytes", "mtime", "bucket_width", "bucket_height"]
    for start in range(0, table.num_rows, _KEY_CHUNK):
        chunk = table.slice(start, _KEY_CHUNK)
        columns = [chunk.column(name).to_pylist() for name in identity]
        key[start : start + chunk.num_rows] = latent_keys(zip(*columns, strict=True), latent_recipe)
        texts: dict[str, str] = {}  # a caption repeated in the chunk is keyed once
        for row, value in enumerate(caption[start : start + _KEY_CHUNK].to_pylist(), start):
            found = texts.get(value or "")
            text[row] = (
                found if found is not None else texts.setdefault(value or "", text_key(value or "", text_recipe))
            )
    widths, heights = (table.column(n).to_numpy().astype(np.int32) for n in ("bucket_width", "bucket_height"))
    return ImageJobs(root, path, caption, widths, heights, key, text)


def jobs_for(scan: ScanTable, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]) -> list[ImageJob]:
    """One job per scan row, keyed under the given recipes."""
    table = pa.Table.from_pylist([{c: row.get(c) for c in JOB_COLUMNS} for row in scan.rows])
    return job_columns(table, scan.root, latent_recipe, text_recipe).rows() if scan.rows else []


def read_jobs(scan_dir: str, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]) -> ImageJobs:
    """The scan's rows as keyed columns."""
    table, root = read_scan_columns(scan_dir, JOB_COLUMNS)
    return job_columns(table, root, latent_recipe, text_recipe)


def _bad_input_keys(cache: str) -> set[str]:
    """Keys of the records the last build skipped as bad input (CACHE/errors.jsonl). A changed
    image gets another key, so it is expected again."""
    try:
        raw = storage.read_bytes(storage.join(cache, ERRORS))
    except FileNotFoundError:
        return set()
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return {str(r["key"]) for r in rows if r.get("kind") in BAD_INPUT and r.get("key")}


def expected_columns(cache: str, config: CacheConfig, scan_dir: str) -> tuple[ImageJobs, int]:
    """The scan rows the cache must hold, as columns keyed under its config's recipes, and how many rows the
    last build skipped as bad input (not expected)."""
    jobs = read_jobs(scan_dir, config.latent_recipe(), config.text_recipe())
    skipped = np.array(sorted(_bad_input_keys(cache)), dtype=f"S{KEY_CHARS}")
    kept = np.flatnonzero(~np.isin(jobs.key, skipped)) if len(skipped) else np.arange(len(jobs))
    return (jobs.take(kept) if len(kept) < len(jobs) else jobs), len(jobs) - len(kept)


def expected_jobs(cache: str, config: CacheConfig, scan_dir: str) -> tuple[list[ImageJob], int]:
    """expected_columns as ImageJobs."""
    jobs, skipped = expected_columns(cache, config, scan_dir)
    return jobs.rows(), skipped
