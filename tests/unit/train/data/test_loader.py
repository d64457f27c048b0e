"""stk.train.data.loader without a cache: a directory without a manifest, and BatchLoader's errors, close and shard
lookahead. On a real cache: tests/integration/test_train_data.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from support.combined_scans import CENTER_OFFSET, STYLE, write_scan
from support.processes import loader_threads

from stk.datagen import make_image
from stk.errors import InputError
from stk.train.data.batch import Batch
from stk.train.data.loader import BatchLoader, CacheData, ImageData


def test_a_directory_without_a_manifest_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no manifest\.json"):
        CacheData(str(tmp_path))


# --- BatchLoader ------------------------------------------------------------------------------------------------


class FakeData:
    """A TrainData whose loads take `delay` and fail for the key `fail`; it records what it was asked."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.delay, self.fail = delay, fail
        self.loads = 0
        self.prefetched: list[list[str]] = []

    def buckets(self) -> dict[tuple[int, int], list[str]]:
        return {}

    def load(self, keys: list[str]) -> Batch:
        self.loads += 1
        time.sleep(self.delay)
        if self.fail in keys:
            raise ValueError(f"cannot load {self.fail}")
        return Batch(keys, torch.zeros(len(keys), 2, dtype=torch.int64), torch.zeros(len(keys), 2, dtype=torch.int64))

    def prefetch(self, keys: list[str]) -> None:
        self.prefetched.append(keys)

    def close(self) -> None:
        pass


def test_an_exception_in_load_is_raised_from_iteration_and_stops_the_threads() -> None:
    before = set(threading.enumerate())
    loader = BatchLoader(FakeData(fail="k3"), ([f"k{i}"] for i in range(10)), threads=2, prefetch=3)
    got = []
    with pytest.raises(ValueError, match="cannot load k3"):
        for batch in loader:
            got.append(batch.keys)
    assert got == [["k0"], ["k1"], ["k2"]]
    assert next(iter(loader), None) is None, "a loader that failed goes on"
    assert loader_threads() == [] and set(threading.enumerate()) <= before


def test_close_mid_iteration_returns_promptly_and_leaves_no_thread() -> None:
    before = set(threading.enumerate())
    data = FakeData(delay=0.4)
    loader = BatchLoader(data, ([f"k{i}"] for i in range(40)), threads=2, prefetch=8, shard_lookahead=16)
    assert next(loader).keys == ["k0"]
    started = time.perf_counter()
    loader.close()
    took = time.perf_counter() - started
    assert took < 1.0, f"close() took {took:.2f} s: it waited for queued loads"  # at most the 2 running ones
    assert data.loads <= 1 + 2 * 2, data.loads
    assert loader_threads() == [] and set(threading.enumerate()) <= before
    assert next(loader, None) is None
    loader.close()  # twice is fine


def test_close_from_another_thread_ends_the_iteration_quietly() -> None:
    loader = BatchLoader(FakeData(delay=0.1), ([f"k{i}"] for i in range(100)), threads=2, prefetch=4)
    closer = threading.Timer(0.5, loader.close)
    closer.start()
    got = [batch.keys for batch in loader]  # a signal handler's close(): the loop just ends
    closer.join()
    assert 1 <= len(got) < 100 and got == [[f"k{i}"] for i in range(len(got))]
    assert loader_threads() == []


def test_prefetch_runs_in_order_up_to_the_shard_lookahead() -> None:
    data = FakeData(delay=0.05)
    batches = [[f"k{i}"] for i in range(20)]
    loader = BatchLoader(data, iter(batches), threads=1, prefetch=2, shard_lookahead=5)
    next(loader)
    deadline = time.monotonic() + 5
    while len([b for b in data.prefetched if b != batches[0]]) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # time to run further ahead, if it did
    assert batches[1:6] == [b for b in data.prefetched if b != batches[0]], "not the next 5 batches"
    assert data.loads <= 3, "loads ran further ahead than `prefetch`"
    rest = list(loader)
    assert [b.keys for b in rest] == batches[1:]
    assert data.prefetched == sorted(data.prefetched, key=batches.index), "prefetches out of order"


def test_images_on_the_fly_take_their_dataset_s_crop(tmp_path: Path) -> None:
    """The style set is cropped at random (as stk-cache crops it), the photos, which give none, at --crop's center."""
    data = ImageData(str(write_scan(tmp_path)), vae_scale_factor=8)
    offsets = {
        (h, w): {tuple(t) for t in data.load(keys.astype(str).tolist()).crop_top_left.tolist()}
        for (h, w), keys in data.bucket_keys().items()
    }
    assert offsets[(4, 6)] == {(0, 0)}  # photos: 72x48 fits its 48x32 bucket whole
    assert len(offsets[(8, 8)]) > 1 and offsets[(8, 8)] != {CENTER_OFFSET}  # style: one offset per image


def test_an_image_replaced_after_the_scan_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """--vae-on-the-fly trained on the new picture, silently."""
    data = ImageData(str(write_scan(tmp_path)), vae_scale_factor=8)
    replaced = tmp_path / "images" / STYLE / "im0.png"
    make_image(200, 40, seed=9).save(replaced)
    keys = data.bucket_keys()[(8, 8)].astype(str).tolist()
    with pytest.raises(InputError, match=rf"^{replaced}: changed since stk-scan read it .*run stk-scan again"):
        data.load(keys)
