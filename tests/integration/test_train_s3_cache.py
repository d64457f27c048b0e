"""An s3:// cache read through node-local copies: prefetch fetches exactly the shards needed, loads do not fetch
again, LRU eviction, several threads at once, and no lock held during a download.

On the session's three-shard SDXL cache (support.train_caches)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.train_caches import Built, assert_same_batch, sampler_batches
from support.weed_server import S3_ENV, s3_client

from stk import storage
from stk.shards import Manifest, shard_location
from stk.train.data.batch import Batch
from stk.train.data.loader import BatchLoader, CacheData

integration = pytest.mark.integration


@pytest.fixture(scope="module")
def built(train_data_built: Built) -> Built:
    """The session's three-shard cache (support.train_caches), by the name these tests give it."""
    return train_data_built


@pytest.fixture(scope="module")
def s3_cache(s3_server: str, built: Built) -> Iterator[str]:
    """The local cache uploaded to the test S3 server, this process's stk.storage pointed at it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in S3_ENV.items():
            patch.setenv(name, value)
        storage.configure_s3(s3_server)
        try:
            bucket = f"stk-train-{uuid.uuid4().hex[:10]}"
            s3_client(s3_server).create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/cache"
            for name in built.shards:
                storage.upload_file(str(built.cache / "shards" / name), shard_location(url, name))
            storage.upload_file(str(built.cache / "manifest.json"), storage.join(url, "manifest.json"))
            yield url
        finally:
            storage.configure_s3(None)


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shard names every storage.download_file is asked for, in order, from any thread."""
    asked: list[str] = []
    real = storage.download_file

    def counting(location: str, local_path: str) -> None:
        asked.append(location.rsplit("/", 1)[1])
        real(location, local_path)

    monkeypatch.setattr(storage, "download_file", counting)
    return asked


def copies(directory: Path) -> dict[str, tuple[int, int]]:
    """Shard name -> (inode, mtime) of the copies in a local directory; a temp file left there fails."""
    found = {}
    for path in directory.iterdir():
        assert not path.name.startswith(".tmp"), f"a temp file was left: {path.name}"
        stat = path.stat()
        found[path.name.split("-", 1)[1]] = (stat.st_ino, stat.st_mtime_ns)
    return found


@integration
def test_prefetch_fetches_exactly_the_shards_of_those_keys_and_load_then_fetches_nothing(
    built: Built, s3_cache: str, downloads: list[str], tmp_path: Path
) -> None:
    local_dir = tmp_path / "copies"
    a, b, c = built.shards
    with CacheData(s3_cache, local_dir=str(local_dir)) as data, CacheData(str(built.cache)) as local:
        assert data.buckets() == local.buckets()
        assert copies(local_dir) == {} and downloads == [], "opening fetched a shard"
        keys = built.pure(b)
        assert keys
        data.prefetch(keys)
        fetched = copies(local_dir)
        assert sorted(fetched) == [b] and downloads == [b]
        batch = data.load(keys)
        assert_same_batch(batch, local.load(keys))
        assert copies(local_dir) == fetched and downloads == [b], "load fetched again"

        # latents in c whose caption is in a (SHARED_CAPTION, first met in the first run)
        in_c = [k for k, shard in built.latent_shard.items() if shard == c]
        mixed = built.one_bucket([k for k in in_c if built.text_shard[built.text_of[k]] == a])
        assert mixed, "no latent whose caption sits in another shard"
        data.prefetch(mixed)
        assert sorted(copies(local_dir)) == sorted([a, b, c]) and sorted(downloads) == sorted([a, b, c])
        assert_same_batch(data.load(mixed), local.load(mixed))
        assert len(downloads) == 3


@integration
def test_past_max_local_bytes_the_least_recently_used_copy_goes(
    built: Built, s3_cache: str, downloads: list[str], tmp_path: Path
) -> None:
    local_dir = tmp_path / "copies"
    a, b, c = built.shards
    manifest = Manifest.load(str(built.cache))
    assert manifest is not None
    size = {s["name"]: int(s["bytes"]) for s in manifest.shards}
    limit = size[a] + max(size[b], size[c])  # a and one other fit, not all three
    with (
        CacheData(s3_cache, local_dir=str(local_dir), max_local_bytes=limit) as data,
        CacheData(str(built.cache)) as local,
    ):
        for shard, held in [(a, {a}), (b, {a, b}), (a, {a, b}), (c, {a, c})]:  # a read again: b is the oldest
            keys = built.pure(shard)[:2]
            assert_same_batch(data.load(keys), local.load(keys))
            assert set(copies(local_dir)) == held, shard
        assert downloads == [a, b, c]
        keys = built.pure(b)[:2]
        assert_same_batch(data.load(keys), local.load(keys))  # fetched again, evicting a
        assert set(copies(local_dir)) == {b, c} and downloads == [a, b, c, b]


@integration
@pytest.mark.parametrize("limited", [False, True], ids=["no-limit", "one-shard-limit"])
def test_threads_prefetching_and_loading_at_once_read_the_right_data(
    built: Built, s3_cache: str, downloads: list[str], tmp_path: Path, limited: bool
) -> None:
    manifest = Manifest.load(str(built.cache))
    assert manifest is not None
    limit = max(int(s["bytes"]) for s in manifest.shards) + 1 if limited else None
    with (
        CacheData(s3_cache, local_dir=str(tmp_path / "copies"), max_local_bytes=limit) as data,
        CacheData(str(built.cache)) as local,
    ):
        batches = sampler_batches(local, batch_size=2, repeats=2)
        failures: list[BaseException] = []

        def work(offset: int) -> None:
            try:
                for keys in batches[offset:] + batches[:offset]:
                    data.prefetch(keys)
                    assert_same_batch(data.load(keys), local.load(keys))
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(i * len(batches) // 4,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a reader thread hangs"
        assert not failures, failures[0]
        if not limited:
            assert sorted(downloads) == sorted(built.shards), "one download per shard, whatever the threads"
        # and a loader over S3 gives what the local cache gives
        with BatchLoader(data, batches, threads=3, prefetch=3, shard_lookahead=8) as loader:
            for batch, keys in zip(loader, batches, strict=True):
                assert_same_batch(batch, local.load(keys))


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """call() on a daemon thread; fails, instead of hanging the run, when it does not return in time."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for {seconds} s"
    assert result, "it raised"
    return result[0]


@integration
def test_no_lock_is_held_while_a_shard_downloads(
    built: Built, s3_cache: str, downloads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _, c = built.shards
    gate, entered = threading.Event(), threading.Event()
    counting = storage.download_file

    def gated(location: str, local_path: str) -> None:
        if location.endswith(c):
            entered.set()
            gate.wait(30)
        counting(location, local_path)

    monkeypatch.setattr(storage, "download_file", gated)
    with CacheData(s3_cache, local_dir=str(tmp_path / "copies")) as data, CacheData(str(built.cache)) as local:
        in_a, in_c = built.pure(a)[:2], built.pure(c)[:2]
        data.load(in_a)
        prefetching = threading.Thread(target=data.prefetch, args=(in_c,))
        prefetching.start()
        try:
            assert entered.wait(10)
            # c is downloading: a is read meanwhile, through the same reader
            assert_same_batch(within(10, lambda: data.load(in_a)), local.load(in_a))
            waiting: list[Batch] = []
            loading = threading.Thread(target=lambda: waiting.append(data.load(in_c)))
            loading.start()
            time.sleep(0.3)
            assert loading.is_alive() and not waiting, "read c before its download finished"
        finally:
            gate.set()
        prefetching.join(10)
        loading.join(10)
        assert_same_batch(waiting[0], local.load(in_c))
        assert downloads == [a, c], "two threads asking for one shard downloaded it twice"
