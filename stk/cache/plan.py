"""What to encode, and which rank encodes it.

Work is cut into batches that do not depend on the number of ranks (one bucket per latent
batch, captions in sorted order), and whole batches go to ranks balanced by pixels. Every
sample is therefore encoded in the same batch whatever the rank count, which is what makes 1
rank and N ranks give bitwise-equal tensors on CPU.
"""

from __future__ import annotations

import heapq
import os

from stk import storage
from stk.shards.jobs import ImageJob

__all__ = ["assign", "latent_batches", "local_work_dir", "text_batches"]


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
