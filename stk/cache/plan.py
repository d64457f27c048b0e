"""What to encode, and which rank encodes it.

Work is cut into batches that do not depend on the number of ranks (one bucket per latent
batch; captions ordered by token count, so an LLM text encoder pads little), and whole batches go
to ranks balanced by pixels and tokens. Every
sample is therefore encoded in the same batch whatever the rank count, which is what makes 1
rank and N ranks give bitwise-equal tensors on CPU.

Planning works on columns (stk.shards.jobs.ImageJobs, numpy and Arrow arrays): a few hundred bytes an
image, no Python object per image; a rank's share holds its rows only, and makes ImageJobs one
batch at a time.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.errors import InputError
from stk.scan.reader import read_scan_columns
from stk.shards import CacheReader, Manifest
from stk.shards.config import CacheConfig
from stk.shards.jobs import JOB_COLUMNS, ImageJobs, job_columns
from stk.shards.keys import KEY_CHARS, text_key

if TYPE_CHECKING:
    from stk.models.components import TextEncoder

__all__ = [
    "Captions",
    "RowShare",
    "Share",
    "assign",
    "batch_bounds",
    "batch_sums",
    "cached_keys",
    "captions_at",
    "distinct_captions",
    "latent_batches",
    "local_work_dir",
    "owned",
    "rank_share",
    "spans",
    "text_batches",
    "text_costs",
    "token_counts",
]

TOKENIZE_CHUNK = 4096  # captions per tokenizer call: fast tokenizers batch them, memory stays small
# a rank's share as rank 0 sends it: its images' scan table rows in batch order and their batches' bounds, then the
# sources (Captions.source) of its captions in batch order and their batches' bounds
RowShare = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Captions:
    """Distinct captions as columns: their text keys, and where each one's text is: a row of the scan table's
    caption column (`source` >= 0) or one of the `extra` captions (`source` -1 - i). No copy of the texts."""

    key: np.ndarray
    source: np.ndarray  # int64
    column: pa.ChunkedArray
    extra: list[str]

    def __len__(self) -> int:
        return len(self.key)

    def take(self, rows: np.ndarray) -> Captions:
        return Captions(self.key[rows], self.source[rows], self.column, self.extra)

    def texts(self, start: int, stop: int) -> list[str]:
        """The captions [start, stop)."""
        source = self.source[start:stop]
        scanned = np.flatnonzero(source >= 0)
        out = [self.extra[-1 - s] if s < 0 else "" for s in source.tolist()]
        for at, text in zip(scanned.tolist(), self.column.take(pa.array(source[scanned])).to_pylist(), strict=True):
            out[at] = text or ""
        return out

    def rows(self, start: int, stop: int) -> list[tuple[str, str]]:
        """(key, caption) of captions [start, stop)."""
        keys = [k.decode() for k in self.key[start:stop].tolist()]
        return list(zip(keys, self.texts(start, stop), strict=True))


def captions_at(column: pa.ChunkedArray, extra: list[str], source: np.ndarray, recipe: dict[str, Any]) -> Captions:
    """The captions at `source` (as Captions.source), keyed under `recipe`."""
    captions = Captions(np.empty(len(source), f"S{KEY_CHARS}"), source, column, extra)
    for start in range(0, len(source), TOKENIZE_CHUNK):
        texts = captions.texts(start, start + TOKENIZE_CHUNK)
        captions.key[start : start + len(texts)] = [text_key(text, recipe) for text in texts]
    return captions


Item = TypeVar("Item", ImageJobs, Captions)


@dataclass
class Share(Generic[Item]):
    """A rank's batches (of images or captions): its items in batch order; batch i is items [bounds[i], bounds[i + 1]),
    made into ImageJobs or (key, caption) pairs one batch at a time."""

    items: Item
    bounds: np.ndarray

    def __len__(self) -> int:
        return len(self.items)

    def batches(self) -> Iterator[list[Any]]:
        return (self.items.rows(start, stop) for start, stop in spans(self.bounds))


def spans(bounds: np.ndarray) -> Iterator[tuple[int, int]]:
    """(start, stop) of each batch."""
    return zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)


def batch_bounds(groups: np.ndarray, batch_size: int) -> np.ndarray:
    """Where batches of at most `batch_size` start in sorted items, a batch never crossing from one group (equal
    consecutive values of `groups`) into the next; the number of items closes the list."""
    n = len(groups)
    is_first = np.r_[True, groups[1:] != groups[:-1]] if n else np.zeros(0, bool)
    start_of_group = np.flatnonzero(is_first)[np.cumsum(is_first) - 1]
    starts = np.flatnonzero((np.arange(n) - start_of_group) % batch_size == 0)
    return np.r_[starts, n].astype(np.int64)


def batch_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each batch's sum of `values` (in batch order)."""
    return np.add.reduceat(values, bounds[:-1]) if len(values) else np.zeros(0, values.dtype)


def distinct_captions(jobs: ImageJobs, extra: list[str], recipe: dict[str, Any]) -> Captions:
    """The captions of the jobs (a whole scan table's) and the `extra` ones, each once, in key order."""
    keys, first = np.unique(jobs.text_key, return_index=True)
    extra_keys = np.array([text_key(caption, recipe) for caption in extra], dtype=jobs.text_key.dtype)
    source = np.concatenate([first.astype(np.int64), -1 - np.arange(len(extra), dtype=np.int64)])
    keys, first = np.unique(np.concatenate([keys, extra_keys]), return_index=True)
    return Captions(keys, source[first], jobs.caption, extra)


def latent_batches(jobs: ImageJobs, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows in (bucket, path) order and the bounds of their batches, one bucket each."""
    table = pa.table({"h": jobs.bucket_height, "w": jobs.bucket_width, "path": jobs.path})
    order = pc.sort_indices(table, [("h", "ascending"), ("w", "ascending"), ("path", "ascending")]).to_numpy()
    bucket = jobs.bucket_height[order].astype(np.int64) << 32 | jobs.bucket_width[order].astype(np.int64)
    return order, batch_bounds(bucket, batch_size)


def token_counts(encoders: Sequence[TextEncoder], captions: Captions) -> np.ndarray:
    """Each caption's length in tokens: the most any of the family's tokenizers gives, capped at what that encoder
    reads (its max_length). Tokenizing is cheap next to encoding; no model runs."""
    counts = np.zeros(len(captions), np.int32)
    for start in range(0, len(captions), TOKENIZE_CHUNK):
        chunk = captions.texts(start, start + TOKENIZE_CHUNK)
        for encoder in encoders:
            ids = encoder.tokenizer(chunk, truncation=True, max_length=encoder.max_length)["input_ids"]
            lengths = np.fromiter((len(tokens) for tokens in ids), np.int32, len(chunk))
            np.maximum(counts[start : start + len(chunk)], lengths, out=counts[start : start + len(chunk)])
    return counts


def text_batches(keys: np.ndarray, tokens: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Captions (by their keys and token counts) in (tokens, key) order and the bounds of batches of `batch_size`:
    captions of similar length share a batch, so one padded to the longest pads little."""
    order = np.lexsort((keys, tokens)) if len(keys) else np.zeros(0, np.int64)
    return order, np.r_[np.arange(0, len(keys), batch_size), len(keys)].astype(np.int64)


def text_costs(tokens: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """A caption batch's cost for `assign` (`tokens` in batch order): its captions times its longest one's tokens
    (what a padded batch runs)."""
    if len(bounds) < 2:
        return np.zeros(0, np.int64)
    longest = np.maximum(np.maximum.reduceat(tokens, bounds[:-1]), 1) if len(tokens) else np.ones(len(bounds) - 1)
    return np.diff(bounds) * longest.astype(np.int64)


def assign(costs: Sequence[int] | np.ndarray, ranks: int) -> list[list[int]]:
    """Indices of batches for each rank: each batch, largest first, to the least loaded rank."""
    values = costs.tolist() if isinstance(costs, np.ndarray) else list(costs)
    heap = [(0, rank) for rank in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        load, rank = heapq.heappop(heap)
        out[rank].append(index)
        heapq.heappush(heap, (load + values[index], rank))
    return [sorted(indices) for indices in out]


def owned(order: np.ndarray, bounds: np.ndarray, batches: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The items of some batches (indices into `order`'s batches), in batch order, and their batches' bounds."""
    sizes = np.diff(bounds)
    mine = np.zeros(len(sizes), bool)
    mine[batches] = True
    items = order[np.repeat(mine, sizes)]
    return items, np.r_[0, np.cumsum(sizes[mine])].astype(np.int64)


def cached_keys(cache: str, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """The latent and text keys the cache's listed shards hold (sorted bytes arrays)."""
    if not manifest.shards:
        return np.zeros(0, "S1"), np.zeros(0, "S1")
    with CacheReader(cache) as reader:
        return reader.latent_key_array(), reader.text_key_array()


def rank_share(
    scan_dir: str, config: CacheConfig, planned: int, extra: list[str], share: RowShare
) -> tuple[Share[ImageJobs], Share[Captions]]:
    """A rank's batches from its share of row numbers (of a scan table of `planned` rows), read from the scan table by
    the rank itself: the plan sends numbers, not the rows."""
    table, root = read_scan_columns(scan_dir, JOB_COLUMNS)
    if table.num_rows != planned:
        raise InputError(
            f"{scan_dir}: the scan table changed while stk-cache read it ({planned} rows, now {table.num_rows}): "
            "let stk-scan finish, then rerun stk-cache"
        )
    rows, bounds, sources, text_bounds = share
    jobs = job_columns(table.take(pa.array(rows, pa.int64())), root, config.latent_recipe(), config.text_recipe())
    captions = captions_at(table.column("caption"), extra, sources, config.text_recipe())
    return Share(jobs, bounds), Share(captions, text_bounds)


def local_work_dir(cache: str, rank: int) -> str:
    """Where shards are written before they are listed: beside the cache, or a temp dir for S3."""
    if storage.is_s3(cache):
        base = os.environ.get("STK_CACHE_WORK_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "stk-cache")
        return os.path.join(base, f"rank{rank:05d}")
    return storage.join(cache, "shards")
