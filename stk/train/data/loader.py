"""The data side of stk-train: micro-batches from a cache (CacheData) or straight from the images
(ImageData, for --vae-on-the-fly), loaded ahead of the training step by BatchLoader.

A source groups its keys by latent shape (`bucket_keys()`, bytes arrays, what BucketSampler draws from) and turns
one rank's keys for one micro-step into a Batch (`load(keys)`). BatchLoader calls `load` on a few
threads, `prefetch` micro-batches ahead and in order, and asks the source to warm the batches
further ahead (`prefetch(keys)`: for an s3:// cache, whole shards downloaded to node-local disk),
so the step waits on neither decompression nor S3.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from stk.errors import CacheIncomplete, InputError
from stk.images.preprocess import CropMode, Preprocessed, PreprocessError
from stk.log import get_logger
from stk.shards import CacheReader, Manifest, TextRecord
from stk.shards.config import CacheConfig
from stk.shards.jobs import ImageJob, ImageJobs, read_jobs
from stk.shards.keys import text_key
from stk.shards.scanned import ChangedSinceScan
from stk.train.data.batch import Batch, collate_text, stack_float32
from stk.train.data.sampler import key_array

__all__ = ["BatchLoader", "CacheData", "ImageData", "TrainData"]

log = get_logger("train")
BucketShape = tuple[int, int]


class TrainData(Protocol):
    def buckets(self) -> dict[BucketShape, list[str]]:
        """Latent (h, w) -> its keys, sorted: the same on every rank."""

    def bucket_keys(self) -> dict[BucketShape, np.ndarray]:
        """buckets() as bytes arrays (UTF-8): what stays compact at 100M samples."""

    def load(self, keys: list[str]) -> Batch:
        """One micro-batch (keys of one bucket), in the order given; thread-safe."""

    def prefetch(self, keys: list[str]) -> None:
        """Warm what load(keys) will need (S3 shards); may do nothing."""

    def caption_arrays(self, caption: str) -> dict[str, np.ndarray] | None:
        """A caption's stored embedding (validation prompts, the empty caption), or None if not stored."""

    @property
    def validation_prompts(self) -> list[str]:
        """The prompts the data source holds embeddings of for samples."""

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------- cache


class CacheData:
    """TrainData from a cache made by stk-cache (a directory or s3://); thread-safe.

    Every shard is checked against the manifest's sha256 before its first sample is used (unless
    `check_sha256` is off): a damaged one raises CacheIncomplete (see stk/shards/integrity.py).
    For an s3:// cache, whole shards are kept in `local_dir` (a temp dir if None; the ranks of a node
    may share one), at most `max_local_bytes` of them in it (see stk/shards/localcopies.py).
    """

    def __init__(
        self,
        cache: str,
        local_dir: str | None = None,
        max_local_bytes: int | None = None,
        check_sha256: bool = True,
    ) -> None:
        self.cache = cache
        self.reader = CacheReader(
            cache, local_dir=local_dir, max_local_bytes=max_local_bytes, check_sha256=check_sha256
        )
        try:
            self.manifest: Manifest = self.reader.manifest
            self.config: CacheConfig = self.manifest.cache_config(cache)
            self._buckets = self.reader.bucket_keys()
        except BaseException:
            self.reader.close()
            raise

    def buckets(self) -> dict[BucketShape, list[str]]:
        return {hw: [key.decode() for key in keys.tolist()] for hw, keys in self._buckets.items()}

    def bucket_keys(self) -> dict[BucketShape, np.ndarray]:
        return dict(self._buckets)

    def load(self, keys: list[str]) -> Batch:
        records = [self.reader.latent(key) for key in keys]
        texts: dict[str, TextRecord] = {}
        for record in records:
            if record.text_key not in texts:
                try:
                    texts[record.text_key] = self.reader.text(record.text_key)
                except KeyError:
                    raise InputError(
                        f"{self.cache}: the caption embedding of {record.path} (text key {record.text_key}) is "
                        "missing: the cache is incomplete (stk-cache verify, then stk-cache again)"
                    ) from None
        logvars = [s.logvar for s in records if s.logvar is not None]
        return Batch(
            keys=list(keys),
            original_size=torch.tensor([s.original_size for s in records], dtype=torch.int64).reshape(-1, 2),
            crop_top_left=torch.tensor([s.crop_top_left for s in records], dtype=torch.int64).reshape(-1, 2),
            mean=stack_float32([s.mean for s in records]),
            logvar=stack_float32(logvars) if len(logvars) == len(records) else None,
            text=collate_text([texts[s.text_key].arrays for s in records]),
        )

    def caption_arrays(self, caption: str) -> dict[str, np.ndarray] | None:
        key = text_key(caption, self.config.text_recipe())
        try:
            return self.reader.text(key).arrays
        except KeyError:
            return None

    @property
    def validation_prompts(self) -> list[str]:
        return list(self.manifest.validation_prompts)

    def prefetch(self, keys: list[str]) -> None:
        """Download (S3) or check (local) the shards that hold these latents, then those that hold their
        captions' embeddings."""
        self.reader.prefetch(keys)
        self.reader.prefetch({self.reader.text_key(key) for key in keys})

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> CacheData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------- images

_PATH_CHUNK = 65_536  # paths made bytes at a time: their Python values live only that long


def _path_buckets(jobs: ImageJobs, factor: int) -> tuple[dict[BucketShape, np.ndarray], dict[BucketShape, np.ndarray]]:
    """Latent (h, w) -> its rows' paths (UTF-8 bytes, sorted) and, beside them, the rows: columns, no Python object
    per row."""
    paths = np.concatenate(
        [key_array(jobs.path[start : start + _PATH_CHUNK].to_pylist()) for start in range(0, len(jobs), _PATH_CHUNK)]
        or [np.zeros(0, "S1")]
    )
    height, width = jobs.bucket_height // factor, jobs.bucket_width // factor
    order = np.lexsort((paths, width, height))
    bucket = height[order].astype(np.int64) << 32 | width[order]
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]]) if len(order) else np.zeros(0, np.int64)
    by_path, rows = {}, {}
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True):
        hw = (int(height[order[start]]), int(width[order[start]]))
        by_path[hw], rows[hw] = paths[order[start:stop]], order[start:stop]
    return by_path, rows


class ImageData:
    """TrainData for --vae-on-the-fly, straight from a stk-scan table and its images; thread-safe.

    Keys are the table's paths. `load` decodes, resizes and crops with stk.images.preprocess, the code
    stk-cache runs (each dataset's own crop in a scan of several), so with center crops a batch's
    pixels are exactly what the cache would have encoded; the step encodes them with
    Encoders.encode_images. Random crops are drawn per image from `seed` and the image (not from a
    cache key, which depends on the VAE): each image keeps one crop for the whole run.
    """

    def __init__(self, scan_dir: str, vae_scale_factor: int, crop: CropMode = CropMode.CENTER, seed: int = 0) -> None:
        self.scan_dir = scan_dir
        self.vae_scale_factor = vae_scale_factor
        self.crop = CropMode(crop)
        # the latent key of a made-up recipe: a stable per-image seed for random crops
        self._jobs = read_jobs(scan_dir, {"on_the_fly_crop_seed": seed}, {}, seen=True)
        jobs, f = self._jobs, vae_scale_factor
        bad = np.flatnonzero((jobs.bucket_width % f != 0) | (jobs.bucket_height % f != 0))
        if len(bad):
            raise InputError(
                f"{scan_dir}: bucket {jobs.bucket_width[bad[0]]}x{jobs.bucket_height[bad[0]]} is not a multiple of the "
                f"VAE's scale factor {f}: scan again with an --alignment that is"
            )
        self._buckets, self._rows = _path_buckets(jobs, f)

    def buckets(self) -> dict[BucketShape, list[str]]:
        return {
            hw: [path.decode("utf-8", "surrogateescape") for path in paths.tolist()]
            for hw, paths in self._buckets.items()
        }

    def bucket_keys(self) -> dict[BucketShape, np.ndarray]:
        return dict(self._buckets)

    def bucket_rows(self) -> dict[BucketShape, np.ndarray]:
        """The scan table's row of each of bucket_keys()'s paths, beside it."""
        return dict(self._rows)

    def load(self, keys: list[str]) -> Batch:
        rows = self._find(keys)
        unknown = [key for key, row in zip(keys, rows.tolist(), strict=True) if row < 0]
        if unknown:
            raise InputError(
                f"{len(unknown)} paths are not in the scan table {self.scan_dir} (the first: {unknown[0]})"
            )
        jobs = self._jobs.take(rows).rows()
        sizes = sorted({(job.bucket_width, job.bucket_height) for job in jobs})
        if len(sizes) != 1:
            raise ValueError(f"a batch holds one bucket, got {sizes}")
        items = [self._pixels(job) for job in jobs]
        return Batch(
            keys=list(keys),
            original_size=torch.tensor([item.original_size for item in items], dtype=torch.int64).reshape(-1, 2),
            crop_top_left=torch.tensor([item.crop_top_left for item in items], dtype=torch.int64).reshape(-1, 2),
            pixels=torch.from_numpy(np.stack([item.pixels for item in items])),  # as stk-cache feeds its VAE
            captions=[job.caption for job in jobs],
        )

    def _find(self, keys: list[str]) -> np.ndarray:
        """The scan rows of these paths (-1: not in the scan), searched in each bucket's sorted paths."""
        wanted, rows = key_array(keys), np.full(len(keys), -1, np.int64)
        for hw, paths in self._buckets.items():
            at = np.minimum(np.searchsorted(paths, wanted), len(paths) - 1)
            found = paths[at] == wanted
            rows[found] = self._rows[hw][at[found]]
        return rows

    def _pixels(self, job: ImageJob) -> Preprocessed:
        try:
            return job.load(self.crop)
        except ChangedSinceScan as exc:
            raise InputError(f"{job.location}: {exc}") from exc
        except PreprocessError as exc:
            raise InputError(f"{job.location}: {exc} (remove it from the scan table, or train from a cache)") from exc
        except OSError as exc:
            raise InputError(f"{job.location}: cannot read: {exc.strerror or exc}") from exc

    def prefetch(self, keys: list[str]) -> None:
        """Nothing to warm: images are read by load() itself."""

    def caption_arrays(self, caption: str) -> dict[str, np.ndarray] | None:
        return None  # captions are encoded each step: nothing is stored

    @property
    def validation_prompts(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------- loader


class BatchLoader:
    """Iterates Batches for `batches` (lists of keys, e.g. a BucketSampler), in their order, loaded on
    `threads` background threads up to `prefetch` batches ahead. Batches up to
    max(prefetch, shard_lookahead) ahead are also handed to `data.prefetch` (on one more thread, in
    order) so their S3 shards are local before they load; 0 turns that off.

    An exception in `load` is raised from `__next__` (and closes the loader); a failed prefetch is
    logged, and its batch's load tries again. `close()` drops the batches not started and waits for
    the ones running (one per thread), so it returns within about one load or one shard download.
    """

    def __init__(
        self,
        data: TrainData,
        batches: Iterable[list[str]],
        threads: int = 4,
        prefetch: int = 8,
        shard_lookahead: int = 32,
    ) -> None:
        if threads < 1 or prefetch < 1 or shard_lookahead < 0:
            raise ValueError("threads and prefetch must be at least 1, shard_lookahead at least 0")
        self.data = data
        self._unreported = 0.0  # seconds __next__ blocked waiting for a batch, since take_wait
        self._batches = iter(batches)
        self._prefetch = prefetch
        self._ahead = max(prefetch, shard_lookahead) if shard_lookahead else prefetch
        self._loads = ThreadPoolExecutor(threads, thread_name_prefix="stk-load")
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="stk-prefetch") if shard_lookahead else None
        self._queued: deque[list[str]] = deque()  # read from `batches`, not loading yet
        self._loading: deque[Future[Batch]] = deque()
        self._read = self._taken = 0  # batches read from `batches`, and handed out
        self._exhausted = False
        self._closed = False
        self._close_lock = threading.Lock()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        self._fill()
        if not self._loading:
            self.close()
            raise StopIteration
        future = self._loading.popleft()
        started = time.perf_counter()
        try:
            batch = future.result()
        except CancelledError:  # closed from another thread meanwhile
            raise StopIteration from None
        except BaseException:
            self.close()
            raise
        finally:
            self._unreported += time.perf_counter() - started
        self._taken += 1
        self._fill()
        return batch

    def take_wait(self) -> float:
        """Seconds waited for data since the last call (a per-step metric)."""
        waited, self._unreported = self._unreported, 0.0
        return waited

    def close(self) -> None:
        """Stop: batches not started are dropped, running loads finish; idempotent, any thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._loads.shutdown(wait=True, cancel_futures=True)
        if self._warmer is not None:
            self._warmer.shutdown(wait=True, cancel_futures=True)
        self._loading.clear()
        self._queued.clear()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self) -> None:
        """Read batches up to the lookahead (each handed to data.prefetch), and start loads up to `prefetch`."""
        try:
            while not self._exhausted and len(self._queued) + len(self._loading) < self._ahead:
                try:
                    keys = list(next(self._batches))
                except StopIteration:
                    self._exhausted = True
                    break
                self._queued.append(keys)
                if self._warmer is not None:
                    self._warmer.submit(self._warm, self._read, keys)
                self._read += 1
            while self._queued and len(self._loading) < self._prefetch:
                self._loading.append(self._loads.submit(self.data.load, self._queued.popleft()))
        except RuntimeError:  # "cannot schedule new futures after shutdown": closed from another thread
            if not self._closed:
                raise

    def _warm(self, index: int, keys: list[str]) -> None:
        if index < self._taken or self._closed:  # handed out already, or stopping: nothing to gain
            return
        try:
            self.data.prefetch(keys)
        except CacheIncomplete:  # a damaged shard: the batch's load raises it, with the same message
            return
        except Exception as exc:  # the batch's own load fetches again, and raises if it fails too
            log.warning("prefetching batch %d failed (its load will try again): %s", index, exc)
