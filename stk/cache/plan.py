"""What to encode, and which rank encodes it.

Work is cut into batches that do not depend on the number of ranks (one bucket per latent
batch; captions ordered by token count, so an LLM text encoder pads little), and whole batches go
to ranks balanced by pixels and tokens. Every
sample is therefore encoded in the same batch whatever the rank count, which is what makes 1
rank and N ranks give bitwise-equal tensors on CPU.

Planning works on columns (stk.shards.jobs.read_keys, ScanBuckets): fixed-width keys and integers, a few dozen
bytes an image once the keys are used, and no Python object per image; the scan table's paths and captions are read
a batch of rows at a time and not kept. A rank's share holds its rows only, and makes ImageJobs one batch at a time.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

from stk import storage
from stk.errors import InputError
from stk.shards import CacheReader, Manifest
from stk.shards.config import CacheConfig
from stk.shards.jobs import IMAGE_COLUMNS, ImageJobs, ScanBuckets, ScanRows, inverse_permutation, job_columns
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
    "caption_chunks",
    "captions_at",
    "distinct_captions",
    "held",
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
    caption column (`source` >= 0) or one of the `extra` captions (`source` -1 - i); on the rank that encodes them,
    their texts too (`text`, read by captions_at). Rank 0 plans without holding the texts."""

    key: np.ndarray
    source: np.ndarray  # int64
    extra: list[str]
    text: pa.Array | None = None  # in key's order: null where the table has none

    def __len__(self) -> int:
        return len(self.key)

    def take(self, rows: np.ndarray) -> Captions:
        text = self.text.take(pa.array(rows, pa.int64())) if self.text is not None else None
        return Captions(self.key[rows], self.source[rows], self.extra, text)

    def texts(self, start: int, stop: int) -> list[str]:
        """The captions [start, stop) (read: captions_at)."""
        assert self.text is not None, "captions_at reads the texts"
        return [text or "" for text in self.text[start:stop].to_pylist()]

    def rows(self, start: int, stop: int) -> list[tuple[str, str]]:
        """(key, caption) of captions [start, stop)."""
        keys = [k.decode() for k in self.key[start:stop].tolist()]
        return list(zip(keys, self.texts(start, stop), strict=True))


def caption_chunks(scan: ScanRows, source: np.ndarray, extra: list[str]) -> Iterator[tuple[np.ndarray, list[str]]]:
    """The texts of captions at `source` (as Captions.source), read from the scan a batch of rows at a time, in
    chunks of at most TOKENIZE_CHUNK: where they are in `source`, and their texts."""
    scanned = np.flatnonzero(source >= 0)
    for at, batch in scan.by_batch(source[scanned], ["caption"]):
        texts = [text or "" for text in batch.column(0).to_pylist()]
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            yield scanned[at[start : start + TOKENIZE_CHUNK]], texts[start : start + TOKENIZE_CHUNK]
    extras = np.flatnonzero(source < 0)
    if len(extras):
        yield extras, [extra[-1 - s] for s in source[extras].tolist()]


def captions_at(scan: ScanRows, extra: list[str], source: np.ndarray, recipe: dict[str, Any]) -> Captions:
    """The captions at `source` (as Captions.source) with their texts, keyed under `recipe`."""
    key, where, texts = np.empty(len(source), f"S{KEY_CHARS}"), [], []
    for at, chunk in caption_chunks(scan, source, extra):
        key[at] = [text_key(text, recipe) for text in chunk]
        where.append(at)
        texts.append(pa.array(chunk, pa.string()))
    inverse = inverse_permutation(np.concatenate([np.zeros(0, np.int64), *where]))
    text = pa.concat_arrays(texts).take(pa.array(inverse)) if texts else pa.array([], pa.string())
    return Captions(key, source, extra, text)


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


def distinct_captions(row_keys: np.ndarray, extra: list[str], recipe: dict[str, Any]) -> Captions:
    """The captions of a scan table (each row's text key) and the `extra` ones, each once, in key order; a caption
    both scanned and extra is the scanned one."""
    keys, first = np.unique(row_keys, return_index=True)
    extra_keys = np.array([text_key(caption, recipe) for caption in extra], dtype=f"S{KEY_CHARS}")
    extra_keys, extra_first = np.unique(extra_keys, return_index=True)
    new = ~held(extra_keys, keys)
    at = np.searchsorted(keys, extra_keys[new])
    source = np.insert(first.astype(np.int64), at, -1 - extra_first[new].astype(np.int64))
    return Captions(np.insert(keys, at, extra_keys[new]), source, extra)


def held(keys: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """Which of `keys` are among `sorted_keys` (sorted bytes arrays): a binary search, no sort of both."""
    if not len(sorted_keys):
        return np.zeros(len(keys), bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys


def latent_batches(keys: ScanBuckets, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows in (bucket, path) order and the bounds of their batches, one bucket each."""
    height, width = keys.bucket_height, keys.bucket_width
    order = np.lexsort((width, height) if keys.path_rank is None else (keys.path_rank, width, height))
    bucket = height[order].astype(np.int64) << 32 | width[order].astype(np.int64)
    return order, batch_bounds(bucket, batch_size)


def token_counts(encoders: Sequence[TextEncoder], captions: Captions, scan: ScanRows) -> np.ndarray:
    """Each caption's length in tokens: the most any of the family's tokenizers gives, capped at what that encoder
    reads (its max_length); the texts are read from the scan a chunk at a time. Tokenizing is cheap next to
    encoding; no model runs."""
    counts = np.zeros(len(captions), np.int32)
    for at, chunk in caption_chunks(scan, captions.source, captions.extra):
        for encoder in encoders:
            ids = encoder.tokenizer(chunk, truncation=True, max_length=encoder.max_length)["input_ids"]
            lengths = np.fromiter((len(tokens) for tokens in ids), np.int32, len(chunk))
            counts[at] = np.maximum(counts[at], lengths)
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
    scan = ScanRows(scan_dir)
    if scan.rows != planned:
        raise InputError(
            f"{scan_dir}: the scan table changed while stk-cache read it ({planned} rows, now {scan.rows}): "
            "let stk-scan finish, then rerun stk-cache"
        )
    rows, bounds, sources, text_bounds = share
    crop = scan.crop[rows] if scan.crop is not None else None
    table = scan.take(rows, IMAGE_COLUMNS)
    jobs = job_columns(table, scan.root, config.latent_recipe(), config.text_recipe(), crop, seen=True)
    captions = captions_at(scan, extra, sources, config.text_recipe())
    return Share(jobs, bounds), Share(captions, text_bounds)


def local_work_dir(cache: str, rank: int) -> str:
    """Where shards are written before they are listed: beside the cache, or a temp dir for S3."""
    if storage.is_s3(cache):
        base = os.environ.get("STK_CACHE_WORK_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "stk-cache")
        return os.path.join(base, f"rank{rank:05d}")
    return storage.join(cache, "shards")
