"""What to encode, and which rank encodes it.

Work is cut into batches that do not depend on the number of ranks (one bucket per latent
batch; captions ordered by token count, so an LLM text encoder pads little), and whole batches go
to ranks balanced by pixels and tokens. Every
sample is therefore encoded in the same batch whatever the rank count, which is what makes 1
rank and N ranks give bitwise-equal tensors on CPU.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stk import storage
from stk.shards.jobs import ImageJob

if TYPE_CHECKING:
    from stk.models.components import TextEncoder

__all__ = ["assign", "latent_batches", "local_work_dir", "text_batches", "text_costs", "token_counts"]

TOKENIZE_CHUNK = 4096  # captions per tokenizer call: fast tokenizers batch them, memory stays small


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


def token_counts(encoders: Sequence[TextEncoder], captions: dict[str, str]) -> dict[str, int]:
    """Each caption's length in tokens, by key: the most any of the family's tokenizers gives, capped at what that
    encoder reads (its max_length). Tokenizing is cheap next to encoding; no model runs."""
    keys = list(captions)
    counts = dict.fromkeys(keys, 0)
    for encoder in encoders:
        for start in range(0, len(keys), TOKENIZE_CHUNK):
            chunk = keys[start : start + TOKENIZE_CHUNK]
            ids = encoder.tokenizer([captions[k] for k in chunk], truncation=True, max_length=encoder.max_length)
            for key, tokens in zip(chunk, ids["input_ids"], strict=True):
                counts[key] = max(counts[key], len(tokens))
    return counts


def text_batches(
    captions: dict[str, str], batch_size: int, tokens: dict[str, int] | None = None
) -> list[list[tuple[str, str]]]:
    """(key, caption) pairs cut into batches of `batch_size` captions, ordered by token count (`tokens`, by key)
    and then key: captions of similar length share a batch, so one padded to the longest pads little. Without
    `tokens`, in key order."""
    items = sorted(captions.items(), key=lambda kv: ((tokens or {}).get(kv[0], 0), kv[0]))
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def text_costs(batches: list[list[tuple[str, str]]], tokens: dict[str, int]) -> list[int]:
    """A caption batch's cost for `assign`: its captions times its longest one's tokens (what a padded batch runs)."""
    return [len(batch) * max(1, *(tokens.get(key, 0) for key, _ in batch)) for batch in batches]


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
