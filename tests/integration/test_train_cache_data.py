"""stk.train.data.loader's CacheData against the cache reader (float32, text padded, --trim-padding, keys), and
BatchLoader's order and wait metric.

On the session's three-shard SDXL cache (support.train_caches)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.processes import loader_threads
from support.train_caches import Built, assert_same_batch, sampler_batches

from stk.shards import CacheReader, Manifest
from stk.shards.jobs import read_jobs
from stk.train.data.batch import Batch
from stk.train.data.loader import BatchLoader, CacheData, TrainData

integration = pytest.mark.integration


@integration
def test_cache_data_buckets_and_batches_are_the_cached_arrays_as_float32(train_data_built: Built) -> None:
    jobs = read_jobs(str(train_data_built.scan), *_recipes(train_data_built.cache)).rows()
    with CacheData(str(train_data_built.cache)) as data, CacheReader(str(train_data_built.cache)) as reader:
        assert data.config.family == "sdxl" and data.manifest.config["family"] == "sdxl"
        assert data.config.norm.scaling_factor == pytest.approx(0.13025) and data.config.norm.shift_factor is None
        buckets = data.buckets()
        assert buckets == reader.buckets()
        assert {k for keys in buckets.values() for k in keys} == {job.key for job in jobs}
        for (h, w), keys in buckets.items():
            assert keys == sorted(keys)
            assert {(reader.latent(k).mean.shape[1:]) for k in keys} == {(h, w)}
            batch_keys = [*keys[:3], keys[0]]  # a repeated key is loaded twice
            batch = data.load(batch_keys)
            assert batch.keys == batch_keys and len(batch) == 4
            assert batch.mean is not None and batch.mean.dtype == torch.float32
            assert batch.mean.shape == (4, 4, h, w) and batch.pixels is None
            assert batch.logvar is not None  # SDXL's example trains on a sample: the cache keeps the log-variance
            assert batch.original_size.dtype == batch.crop_top_left.dtype == torch.int64
            assert batch.text is not None and sorted(batch.text) == ["pooled_prompt_embeds", "prompt_embeds"]
            for i, key in enumerate(batch_keys):
                sample = reader.latent(key)
                assert sample.mean.dtype == np.float16
                assert np.array_equal(batch.mean[i].numpy(), sample.mean.astype(np.float32))
                assert tuple(batch.original_size[i].tolist()) == sample.original_size
                assert tuple(batch.crop_top_left[i].tolist()) == sample.crop_top_left
                text = reader.text(sample.text_key)
                assert batch.text["prompt_embeds"].shape == (4, 77, text.arrays["prompt_embeds"].shape[1])
                for name, array in text.arrays.items():  # untrimmed: all the same length, nothing padded
                    assert batch.text[name].dtype == torch.float32
                    assert np.array_equal(batch.text[name][i].numpy(), array.astype(np.float32)), name


def _recipes(cache: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    config = manifest.cache_config(str(cache))
    return config.latent_recipe(), config.text_recipe()


@integration
def test_a_trim_padding_cache_is_zero_padded_to_the_longest_caption_of_the_batch(train_data_built: Built) -> None:
    with CacheData(str(train_data_built.trimmed)) as data, CacheReader(str(train_data_built.trimmed)) as reader:
        with CacheData(str(train_data_built.cache)) as untrimmed:  # latent keys do not depend on the text settings
            assert data.buckets() == untrimmed.buckets()
        varied = 0
        for keys in data.buckets().values():  # a batch is one bucket
            lengths = [reader.text(reader.latent(k).text_key).length for k in keys]
            varied += len(set(lengths)) > 1
            batch = data.load(keys)
            assert batch.text is not None
            padded, pooled = batch.text["prompt_embeds"], batch.text["pooled_prompt_embeds"]
            assert padded.shape[:2] == (len(keys), max(lengths)) and max(lengths) < 77
            assert pooled.shape == (len(keys), 64) and pooled.dtype == padded.dtype == torch.float32
            for i, (key, length) in enumerate(zip(keys, lengths, strict=True)):
                stored = reader.text(reader.latent(key).text_key).arrays
                assert stored["prompt_embeds"].shape[0] == length
                assert np.array_equal(padded[i, :length].numpy(), stored["prompt_embeds"].astype(np.float32))
                assert not padded[i, length:].any(), "the padding is not zeros"
                assert np.array_equal(pooled[i].numpy(), stored["pooled_prompt_embeds"].astype(np.float32))
        assert varied, "every batch had captions of one length: padding untested"


class Slow:
    """Any TrainData, with every load `delay` seconds slower."""

    def __init__(self, inner: TrainData, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def buckets(self) -> dict[tuple[int, int], list[str]]:
        return self.inner.buckets()

    def load(self, keys: list[str]) -> Batch:
        time.sleep(self.delay)
        return self.inner.load(keys)

    def prefetch(self, keys: list[str]) -> None:
        self.inner.prefetch(keys)

    def close(self) -> None:
        self.inner.close()


@integration
def test_loader_yields_the_batches_in_order_equal_to_direct_loads(train_data_built: Built) -> None:
    with CacheData(str(train_data_built.cache)) as data:
        batches = sampler_batches(data)
        assert len(batches) >= 10
        with BatchLoader(data, iter(batches), threads=3, prefetch=4, shard_lookahead=6) as loader:
            got = list(loader)
        assert [b.keys for b in got] == batches
        for batch, keys in zip(got, batches, strict=True):
            assert_same_batch(batch, data.load(keys))
    assert loader_threads() == []


@integration
def test_wait_grows_with_slow_loads_and_stays_small_with_fast_ones(train_data_built: Built) -> None:
    with CacheData(str(train_data_built.cache)) as data:
        batches = sampler_batches(data)[:8]
        slow = BatchLoader(Slow(data, 0.1), batches, threads=1, prefetch=2)
        for _ in slow:  # a step that takes no time: every load is waited for
            pass
        waited = slow.take_wait()
        assert waited >= 0.6, waited
        assert slow.take_wait() == 0.0

        fast = BatchLoader(data, batches, threads=2, prefetch=4)
        per_step = []
        for _ in fast:
            time.sleep(0.03)  # the step: loads keep ahead of it
            per_step.append(fast.take_wait())
        assert sum(per_step) < 0.15, per_step  # about the first load alone
