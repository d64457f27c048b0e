"""What a scan asks of a cache: its rows keyed under a cache config's recipes, and the rows a cache must hold (those
the last build did not skip as bad input). stk-cache plans and encodes them; stk-cache verify and stk-train check a
cache covers them. Every row is read as columns, a batch of rows at a time (ScanRows), and kept as fixed-width keys
and integers (ScanBuckets); ImageJob objects are made only for the rows one batch encodes. Nothing here loads a model.

In a scan of several datasets a row is encoded with its dataset's crop where it gives one, and keyed under the latent
recipe with that crop (CacheConfig.with_crop): the rows are grouped by crop, each group keyed under its recipe.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.images.preprocess import CropMode, Preprocessed
from stk.scan.reader import CROPS, ScanTable, dataset_rows, open_scan, read_scan_columns, row_crops
from stk.shards.config import CacheConfig
from stk.shards.keys import KEY_CHARS, latent_keys, text_key
from stk.shards.scanned import CHANGED, SEEN_COLUMNS, SeenFile, read_as_scanned, seen_files

__all__ = [
    "ERRORS",
    "IMAGE_COLUMNS",
    "JOB_COLUMNS",
    "ImageJob",
    "ImageJobs",
    "ScanBuckets",
    "ScanRows",
    "expected_columns",
    "expected_keys",
    "inverse_permutation",
    "job_columns",
    "read_jobs",
    "read_keys",
]

ERRORS = "errors.jsonl"  # CACHE/errors.jsonl: the records the last build could not encode
# errors.jsonl kinds that a rerun would meet again: their records are reported, not expected
BAD_INPUT = frozenset({"decode_failed", "nonfinite_latent", "nonfinite_embedding", CHANGED})


@dataclass(frozen=True)
class ImageJob:
    path: str
    location: str
    bucket_width: int
    bucket_height: int
    caption: str
    key: str
    text_key: str
    crop: CropMode | None = None  # its dataset's; None: the command's (--crop)
    seen: SeenFile | None = None  # what the scan recorded of the file; None: not checked

    @property
    def pixels(self) -> int:
        return self.bucket_width * self.bucket_height

    def load(self, crop: CropMode) -> Preprocessed:
        """The image fitted to its bucket, cropped as its dataset asks, else as `crop`; ChangedSinceScan (a
        PreprocessError) for a file that is no longer the one the scan saw."""
        return read_as_scanned(
            self.location, self.seen, self.bucket_width, self.bucket_height, self.crop or crop, self.key
        )


# the scan table's columns a job needs
JOB_COLUMNS = ["path", "caption", "bucket_width", "bucket_height", "bytes", "mtime"]
_IDENTITY = ["path", "bytes", "mtime", "bucket_width", "bucket_height"]  # what a latent key is made of
# the columns of rows whose images are read: the job's, and what the scan recorded of each file
IMAGE_COLUMNS = [*JOB_COLUMNS, *(c for c in SEEN_COLUMNS if c not in JOB_COLUMNS)]
DATASET = "dataset"  # the column naming each row's dataset in a scan of several
_KEY_CHUNK = 65_536  # rows read and keyed at a time: their Python values live only that long


class ScanRows:
    """The scan table opened to be read a batch of rows at a time: its compressed file is held, and each row's bucket
    (8 bytes a row) and, in a scan of several datasets, its crop (1 byte a row: `crop`, as reader.row_crops gives it;
    None in a scan of one source); paths and captions are read when needed, a batch at a time."""

    def __init__(self, scan_dir: str) -> None:
        self._file, self.root = open_scan(scan_dir, JOB_COLUMNS)
        self.scan_dir, self.rows = scan_dir, self._file.metadata.num_rows
        buckets = self._file.read(columns=["bucket_width", "bucket_height"]) if self.rows else None
        self.bucket_width, self.bucket_height = (
            buckets.column(n).to_numpy().astype(np.int32) if buckets else np.zeros(0, np.int32)
            for n in ("bucket_width", "bucket_height")
        )
        several = DATASET in self._file.schema_arrow.names
        self.crop = row_crops(scan_dir, (b.column(0) for b in self.batches([DATASET]))) if several else None

    def batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The table's `columns`, in row order, _KEY_CHUNK rows at a time."""
        return self._file.iter_batches(_KEY_CHUNK, columns=columns) if self.rows else iter(())

    def by_batch(self, rows: np.ndarray, columns: list[str]) -> Iterator[tuple[np.ndarray, pa.RecordBatch]]:
        """Rows (numbers in the table) read a batch at a time: for each batch that holds some, where they are in
        `rows` and their `columns`."""
        order = np.argsort(rows, kind="stable")
        wanted, start = rows[order], 0
        for batch in self.batches(columns):
            low, high = np.searchsorted(wanted, [start, start + batch.num_rows])
            if high > low:
                yield order[low:high], batch.take(pa.array(wanted[low:high] - start))
            start += batch.num_rows

    def take(self, rows: np.ndarray, columns: list[str]) -> pa.Table:
        """These rows' `columns` (those the table has), in the order of `rows`."""
        schema = self._file.schema_arrow
        columns = [c for c in columns if c in schema.names]
        where, parts = [], []
        for at, batch in self.by_batch(rows, columns):
            where.append(at)
            parts.append(batch)
        table = pa.Table.from_batches(parts, pa.schema([schema.field(c) for c in columns]))
        return table.take(pa.array(inverse_permutation(np.concatenate([np.zeros(0, np.int64), *where]))))


def inverse_permutation(order: np.ndarray) -> np.ndarray:
    """Where each item of a permutation went: `inverse[order[i]] == i`, so taking `inverse` of items put in `order`
    puts them back (O(n), where an argsort of `order` is O(n log n))."""
    inverse = np.empty(len(order), np.int64)
    inverse[order] = np.arange(len(order))
    return inverse


def _latent_keys(batch: pa.Table | pa.RecordBatch, recipe: dict[str, Any], crop: np.ndarray | None) -> np.ndarray:
    """Some rows' latent keys: those of each crop (`crop`, as ScanRows.crop; None: the recipe's) under the recipe with
    that crop, the recipe encoded once per crop."""
    key = np.empty(batch.num_rows, dtype=f"S{KEY_CHARS}")
    codes = np.unique(crop) if crop is not None else np.full(1, -1, np.int8)
    for code in codes.tolist():
        rows = np.flatnonzero(crop == code) if len(codes) > 1 else None
        part = batch if rows is None else batch.take(pa.array(rows))
        identities = zip(*(part.column(name).to_pylist() for name in _IDENTITY), strict=True)
        recipe_of_crop = recipe if code < 0 else CacheConfig.with_crop(recipe, CROPS[code])
        key[slice(None) if rows is None else rows] = latent_keys(identities, recipe_of_crop)
    return key


def _keyed(
    batch: pa.Table | pa.RecordBatch,
    latent_recipe: dict[str, Any],
    text_recipe: dict[str, Any],
    crop: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Some rows' latent keys (each under its crop: _latent_keys) and their captions' text keys; a caption repeated
    among them is keyed once."""
    key = _latent_keys(batch, latent_recipe, crop)
    texts: dict[str, str] = {}
    captions = [value or "" for value in batch.column("caption").to_pylist()]
    for value in captions:
        if value not in texts:
            texts[value] = text_key(value, text_recipe)
    return key, np.array([texts[value] for value in captions], dtype=f"S{KEY_CHARS}")


@dataclass
class ImageJobs:
    """Scan rows as columns, keyed: a rank's share of them, or the rows stk-train checks a cache covers; no Python
    object per row. `rows()` makes ImageJobs for the few rows a batch needs."""

    root: str  # the scan's, that relative paths are under (ScanTable.image_location)
    path: pa.ChunkedArray  # strings, as read
    caption: pa.ChunkedArray  # strings, as read: null where the table has none
    bucket_width: np.ndarray  # int32
    bucket_height: np.ndarray  # int32
    key: np.ndarray  # latent keys, bytes (S40)
    text_key: np.ndarray  # each row's caption's text key, bytes (S40)
    crop: np.ndarray  # int8: each row's dataset's crop (ScanRows.crop), -1 where it gives none (the command's)
    dataset: np.ndarray  # int64: each row's place in buckets.json's "datasets" (reader.dataset_rows); -1: one source
    seen: pa.Table | None = None  # the rows' SEEN_COLUMNS, where their images are read (encoded, or on the fly)

    def __len__(self) -> int:
        return len(self.key)

    def take(self, rows: np.ndarray) -> ImageJobs:
        """These rows, in this order."""
        index = pa.array(rows, pa.int64())
        return ImageJobs(
            self.root,
            self.path.take(index),
            self.caption.take(index),
            self.bucket_width[rows],
            self.bucket_height[rows],
            self.key[rows],
            self.text_key[rows],
            self.crop[rows],
            self.dataset[rows],
            self.seen.take(index) if self.seen is not None else None,
        )

    def rows(self, start: int = 0, stop: int | None = None) -> list[ImageJob]:
        """Rows [start, stop) as ImageJobs."""
        stop = len(self) if stop is None else stop
        scan = ScanTable([], self.root)
        paths, captions = self.path[start:stop].to_pylist(), self.caption[start:stop].to_pylist()
        seen = seen_files(self.seen.slice(start, stop - start)) if self.seen is not None else [None] * len(paths)
        return [
            ImageJob(
                path,
                scan.image_location(path),
                int(w),
                int(h),
                caption or "",
                key.decode(),
                text.decode(),
                CROPS[crop] if crop >= 0 else None,
                file,
            )
            for path, caption, w, h, key, text, crop, file in zip(
                paths,
                captions,
                self.bucket_width[start:stop],
                self.bucket_height[start:stop],
                self.key[start:stop],
                self.text_key[start:stop],
                self.crop[start:stop].tolist(),
                seen,
                strict=True,
            )
        ]


def job_columns(
    table: pa.Table,
    root: str,
    latent_recipe: dict[str, Any],
    text_recipe: dict[str, Any],
    crop: np.ndarray | None = None,
    dataset: np.ndarray | None = None,
    seen: bool = False,
) -> ImageJobs:
    """A scan table's rows (JOB_COLUMNS of it), with their crops (as ScanRows.crop) keyed under the given recipes, and
    their datasets (as reader.dataset_rows; None: a scan of one source); with `seen`, the table's SEEN_COLUMNS kept
    to check each image against when it is read."""
    key = np.empty(table.num_rows, dtype=f"S{KEY_CHARS}")
    text = np.empty(table.num_rows, dtype=f"S{KEY_CHARS}")
    for start in range(0, table.num_rows, _KEY_CHUNK):
        stop = min(start + _KEY_CHUNK, table.num_rows)
        part, part_crop = table.slice(start, _KEY_CHUNK), crop[start:stop] if crop is not None else None
        key[start:stop], text[start:stop] = _keyed(part, latent_recipe, text_recipe, part_crop)
    widths, heights = (table.column(n).to_numpy().astype(np.int32) for n in ("bucket_width", "bucket_height"))
    crop = crop if crop is not None else np.full(table.num_rows, -1, np.int8)
    dataset = dataset if dataset is not None else np.full(table.num_rows, -1, np.int64)
    kept = table.select([c for c in SEEN_COLUMNS if c in table.column_names]) if seen else None
    return ImageJobs(
        root, table.column("path"), table.column("caption"), widths, heights, key, text, crop, dataset, kept
    )


def read_jobs(
    scan_dir: str, latent_recipe: dict[str, Any], text_recipe: dict[str, Any], seen: bool = False
) -> ImageJobs:
    """The scan's rows as keyed columns, each with its dataset and that dataset's crop in a scan of several; with
    `seen`, what the scan recorded of each file (job_columns)."""
    table, root = read_scan_columns(scan_dir, [*(IMAGE_COLUMNS if seen else JOB_COLUMNS), DATASET])
    if DATASET not in table.column_names:
        return job_columns(table, root, latent_recipe, text_recipe, seen=seen)
    dataset, crop = dataset_rows(scan_dir, table.column(DATASET).chunks)
    return job_columns(table, root, latent_recipe, text_recipe, crop, dataset, seen)


@dataclass
class ScanBuckets:
    """Every scan row's bucket and place in path order: what batching the rows needs, 8 to 16 bytes a row (read_keys
    gives the keys beside it)."""

    bucket_width: np.ndarray  # int32
    bucket_height: np.ndarray  # int32
    path_rank: np.ndarray | None  # each row's place in path order; None: the rows are in path order

    def __len__(self) -> int:
        return len(self.bucket_width)

    @property
    def pixels(self) -> np.ndarray:
        return self.bucket_width.astype(np.int64) * self.bucket_height

    def take(self, rows: np.ndarray) -> ScanBuckets:
        """These rows, in this order (their path ranks kept: still comparable)."""
        rank = self.path_rank[rows] if self.path_rank is not None else rows.astype(np.int64)
        return ScanBuckets(self.bucket_width[rows], self.bucket_height[rows], rank)


def _path_rank(scan: ScanRows) -> np.ndarray:
    """Each row's place in path order (a stable sort: equal paths in row order), for a table not written in it."""
    paths = pa.chunked_array(batch.column(0) for batch in scan.batches(["path"]))
    return inverse_permutation(pc.sort_indices(paths).to_numpy())


def read_keys(
    scan: ScanRows, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]
) -> tuple[ScanBuckets, np.ndarray, np.ndarray]:
    """Every row's bucket and path order, latent key and caption's text key (bytes, S40) under the recipes, read a
    batch of rows at a time: the paths and captions are not kept, and the keys can be dropped once used."""
    key = np.empty(scan.rows, dtype=f"S{KEY_CHARS}")
    text = np.empty(scan.rows, dtype=f"S{KEY_CHARS}")
    start, last, in_order = 0, "", True
    for batch in scan.batches([*_IDENTITY, "caption"]):
        stop = start + batch.num_rows
        crop = scan.crop[start:stop] if scan.crop is not None else None
        key[start:stop], text[start:stop] = _keyed(batch, latent_recipe, text_recipe, crop)
        paths = batch.column("path")
        in_order = (
            in_order and last <= paths[0].as_py() and pc.all(pc.less_equal(paths[:-1], paths[1:]), min_count=0).as_py()
        )
        last, start = paths[-1].as_py(), stop
    rank = None if in_order else _path_rank(scan)
    return ScanBuckets(scan.bucket_width, scan.bucket_height, rank), key, text


def _bad_input_keys(cache: str) -> np.ndarray:
    """Keys of the records the last build skipped as bad input (CACHE/errors.jsonl), sorted. A changed
    image gets another key, so it is expected again."""
    try:
        raw = storage.read_bytes(storage.join(cache, ERRORS))
    except FileNotFoundError:
        return np.zeros(0, f"S{KEY_CHARS}")
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    keys = {str(r["key"]) for r in rows if r.get("kind") in BAD_INPUT and r.get("key")}
    return np.array(sorted(keys), dtype=f"S{KEY_CHARS}")


def _expected_rows(cache: str, key: np.ndarray) -> np.ndarray | None:
    """The rows (by their latent keys) the cache must hold; None: all of them."""
    skipped = _bad_input_keys(cache)
    kept = np.flatnonzero(~np.isin(key, skipped)) if len(skipped) else None
    return kept if kept is not None and len(kept) < len(key) else None


def expected_columns(cache: str, config: CacheConfig, scan_dir: str) -> tuple[ImageJobs, int]:
    """The scan rows the cache must hold, as columns keyed under its config's recipes, and how many rows the
    last build skipped as bad input (not expected)."""
    jobs = read_jobs(scan_dir, config.latent_recipe(), config.text_recipe())
    kept = _expected_rows(cache, jobs.key)
    return (jobs, 0) if kept is None else (jobs.take(kept), len(jobs) - len(kept))


def expected_keys(cache: str, config: CacheConfig, scan: ScanRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """expected_columns as keys alone, no strings kept: the latent keys and the distinct text keys (sorted) of the
    rows the cache must hold, and which rows those are."""
    _, keys, texts = read_keys(scan, config.latent_recipe(), config.text_recipe())
    kept = _expected_rows(cache, keys)
    if kept is None:
        return keys, np.unique(texts), np.arange(len(keys))
    return keys[kept], np.unique(texts[kept]), kept
