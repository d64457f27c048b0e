"""One rank's encoding: captions first, then images, each batch written to this rank's shards.

Images are decoded and fitted to their bucket on CPU threads a few batches ahead of the
encoder (a bounded queue), so the GPU does not wait on JPEG decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stk.cache.memory import TextPass
from stk.images.preprocess import CropMode, Preprocessed, PreprocessError
from stk.models import Encoders
from stk.shards import LatentRecord, ShardWriter, TextRecord
from stk.shards.config import EncodeSettings
from stk.shards.jobs import ImageJob

__all__ = ["Counters", "encode_latents", "encode_texts"]

PREFETCH_BATCHES = 4


@dataclass
class Counters:
    images: int = 0
    captions: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    text: TextPass = field(default_factory=TextPass)  # the text pass's time and memory peak

    def error(self, path: str, kind: str, reason: str, key: str | None = None) -> None:
        """One errors.jsonl row; `key` (of the latent or text embedding not stored) lets verify
        tell bad input that was reported from samples that are missing."""
        row = {"path": path, "kind": kind, "reason": reason}
        if key is not None:
            row["key"] = key
        self.errors.append(row)


def encode_texts(
    encoders: Encoders,
    batches: Iterable[list[tuple[str, str]]],
    writer: ShardWriter,
    settings: EncodeSettings,
    counters: Counters,
    tick: Callable[[int], None],
) -> None:
    for batch in batches:
        embeddings = encoders.encode_text([caption for _, caption in batch])
        for (key, caption), embedding in zip(batch, embeddings, strict=True):
            if not all(np.isfinite(a).all() for a in embedding.arrays.values()):
                counters.error(caption[:200], "nonfinite_embedding", "text embedding has NaN or Inf: not stored", key)
                continue
            arrays = {}
            for name, array in embedding.arrays.items():
                if settings.trim_padding and array.ndim == 2:
                    array = array[: embedding.length]
                arrays[name] = array.astype(settings.dtype)
            writer.add_text(TextRecord(key, arrays, embedding.length))
            counters.captions += 1
        tick(len(batch))


def _load(job: ImageJob, crop: CropMode) -> Preprocessed | tuple[str, str]:
    """The preprocessed image (cropped as its dataset asks, else as `crop`), or the error kind and the reason it cannot
    be used."""
    try:
        return job.load(crop)
    except PreprocessError as exc:  # ChangedSinceScan too
        return exc.kind, str(exc)
    except OSError as exc:  # missing or unreadable now: a rerun may succeed
        return "unreadable", f"cannot read: {exc.strerror or exc}"


def _prefetched(
    batches: Iterable[list[ImageJob]], crop: CropMode, threads: int
) -> Iterator[tuple[list[ImageJob], list[Preprocessed | tuple[str, str]]]]:
    with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
        pending: list[tuple[list[ImageJob], list[Future[Preprocessed | tuple[str, str]]]]] = []
        for batch in batches:
            pending.append((batch, [pool.submit(_load, job, crop) for job in batch]))
            if len(pending) > PREFETCH_BATCHES:
                done, futures = pending.pop(0)
                yield done, [f.result() for f in futures]
        for done, futures in pending:
            yield done, [f.result() for f in futures]


def encode_latents(
    encoders: Encoders,
    batches: Iterable[list[ImageJob]],
    writer: ShardWriter,
    settings: EncodeSettings,
    threads: int,
    counters: Counters,
    tick: Callable[[int], None],
) -> None:
    for batch, loaded in _prefetched(batches, settings.crop, threads):
        good = [(job, item) for job, item in zip(batch, loaded, strict=True) if isinstance(item, Preprocessed)]
        for job, item in zip(batch, loaded, strict=True):
            if not isinstance(item, Preprocessed):
                counters.error(job.path, *item, key=job.key)
        if good:
            pixels = torch.from_numpy(np.stack([item.pixels for _, item in good]))
            mean, logvar = encoders.encode_images(pixels)
            for i, (job, item) in enumerate(good):
                m, lv = mean[i].numpy(), logvar[i].numpy()
                if not (np.isfinite(m).all() and np.isfinite(lv).all()):
                    counters.error(job.path, "nonfinite_latent", "latent has NaN or Inf: not stored", job.key)
                    continue
                writer.add_latent(
                    LatentRecord(
                        key=job.key,
                        text_key=job.text_key,
                        mean=m.astype(settings.dtype),
                        logvar=lv.astype(settings.dtype) if settings.store_logvar else None,
                        original_size=item.original_size,
                        crop_top_left=item.crop_top_left,
                        path=job.path,
                    )
                )
                counters.images += 1
        tick(len(batch))
