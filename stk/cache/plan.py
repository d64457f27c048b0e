"""What to encode, and which rank encodes it.

Work is cut into batches that do not depend on the number of ranks (one bucket per latent
batch, captions in sorted order), and whole batches go to ranks balanced by pixels. Every
sample is therefore encoded in the same batch whatever the rank count, which is what makes 1
rank and N ranks give bitwise-equal tensors on CPU.
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass
from typing import Any

from stk import storage
from stk.cache.keys import latent_key, text_key
from stk.errors import InputError
from stk.log import get_logger
from stk.metadata import read_parquet

__all__ = ["ImageJob", "ScanInput", "assign", "image_location", "latent_batches", "load_scan", "text_batches"]

log = get_logger("cache")


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


@dataclass
class ScanInput:
    rows: list[dict[str, Any]]
    root: str


def load_scan(scan_dir: str) -> ScanInput:
    """The scan table and the root its paths are relative to."""
    table_path = storage.join(scan_dir, "metadata.parquet")
    summary_path = storage.join(scan_dir, "summary.json")
    if not storage.exists(table_path):
        raise InputError(f"{scan_dir}: no metadata.parquet (run stk-scan first)")
    rows = read_parquet(table_path).to_pylist()
    root = ""
    if storage.exists(summary_path):
        root = json.loads(storage.read_bytes(summary_path)).get("root", "")
    if root and not storage.is_s3(root) and not os.path.isabs(root):
        log.warning(
            "%s records the relative root %r (an older stk-scan): read from the current directory; "
            "rerun stk-scan (it reuses unchanged rows) to record it absolutely", summary_path, root,
        )  # fmt: skip
    missing = {"path", "caption", "bucket_width", "bucket_height", "bytes", "mtime"} - set(rows[0] if rows else {})
    if rows and missing:
        raise InputError(f"{table_path}: not an stk scan table (missing {sorted(missing)})")
    return ScanInput(rows, root)


def image_location(root: str, path: str) -> str:
    """Where a scan row's image is: under the scan's root, unless the row names it in full (an
    absolute path or a URL from a list), or the scan has no root (one made by an older stk-scan
    from a list)."""
    if not root or os.path.isabs(path) or "://" in path:
        return path
    return storage.join(root, path)


def jobs_for(scan: ScanInput, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]) -> list[ImageJob]:
    return [
        ImageJob(
            path=row["path"],
            location=image_location(scan.root, row["path"]),
            bucket_width=row["bucket_width"],
            bucket_height=row["bucket_height"],
            caption=row["caption"] or "",
            key=latent_key(row, latent_recipe),
            text_key=text_key(row["caption"] or "", text_recipe),
        )
        for row in scan.rows
    ]


def latent_batches(jobs: list[ImageJob], batch_size: int) -> list[list[ImageJob]]:
    """Batches of one bucket each, in (bucket, path) order."""
    ordered = sorted(jobs, key=lambda j: (j.bucket_height, j.bucket_width, j.path))
    batches: list[list[ImageJob]] = []
    for job in ordered:
        last = batches[-1] if batches else None
        same = last is not None and (last[0].bucket_width, last[0].bucket_height) == (
            job.bucket_width,
            job.bucket_height,
        )
        if last is not None and same and len(last) < batch_size:
            last.append(job)
        else:
            batches.append([job])
    return batches


def text_batches(captions: dict[str, str], batch_size: int) -> list[list[tuple[str, str]]]:
    """(key, caption) pairs in key order, cut into batches."""
    items = sorted(captions.items())
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def assign(costs: list[int], ranks: int) -> list[list[int]]:
    """Indices of batches for each rank: each batch, largest first, to the least loaded rank."""
    heap = [(0, rank) for rank in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        out[rank].append(index)
        heapq.heappush(heap, (load + costs[index], rank))
    return [sorted(indices) for indices in out]


def local_work_dir(cache: str, rank: int) -> str:
    """Where shards are written before they are listed: beside the cache, or a temp dir for S3."""
    if storage.is_s3(cache):
        base = os.environ.get("STK_CACHE_WORK_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "stk-cache")
        return os.path.join(base, f"rank{rank:05d}")
    return storage.join(cache, "shards")
