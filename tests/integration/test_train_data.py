"""stk.train.data on a real cache: CacheData against the cache reader (float32, text padded, --trim-padding, keys),
BatchLoader's order and wait metric, ImageData against stk.preprocess and the cached latents (on-the-fly ==
cached), and an s3:// cache read through node-local copies: prefetch fetches exactly the shards needed, loads do
not fetch again, LRU eviction, several threads at once, and no lock held during a download.

One tiny SDXL model; 24 generated images scanned at 64 px and cached by stk-cache (subprocesses, as users run
them) in three runs of 8 new images each, so the cache has three shards whose contents are known."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from support.commands import cache_command, cache_env, scan_command, summary_of
from support.processes import loader_threads
from support.weed_server import S3_ENV, s3_client

from stk import storage
from stk.datagen import generate_dataset
from stk.errors import InputError
from stk.models import Family, build_tiny_model, load_encoders
from stk.preprocess import CropMode, preprocess
from stk.scan.reader import read_scan
from stk.shards import CacheReader, Manifest, shard_location
from stk.shards.jobs import jobs_for
from stk.train.batch import Batch
from stk.train.data import BatchLoader, CacheData, ImageData, TrainData
from stk.train.sampler import BucketSampler

integration = pytest.mark.integration
IMAGES, RUNS = 24, 3  # each stk-cache run adds IMAGES // RUNS images in one new shard
SHARED_CAPTION = "a photo of a cat on the mat"


# --- building the caches once -------------------------------------------------------------------------------------


def start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cache_env())


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return summary_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))


@dataclass
class Built:
    model: str
    data: Path  # all the images
    scan: Path  # their scan
    cache: Path  # float16 cache in RUNS shards, one per run
    trimmed: Path  # --trim-padding cache of the same images
    shards: list[str]  # the cache's shards, in the order the runs wrote them
    latent_shard: dict[str, str]  # latent key -> shard name, read with plain h5py
    text_shard: dict[str, str]  # text key -> shard name
    text_of: dict[str, str]  # latent key -> its caption's text key
    shape_of: dict[str, str]  # latent key -> its group ("4x8x12")

    def one_bucket(self, keys: list[str]) -> list[str]:
        """The keys of the latent shape most of `keys` have (a batch is one bucket), sorted."""
        shapes = sorted({self.shape_of[k] for k in keys}, key=lambda s: -sum(self.shape_of[k] == s for k in keys))
        return sorted(k for k in keys if self.shape_of[k] == shapes[0])

    def pure(self, shard: str) -> list[str]:
        """A batch of latent keys of `shard` whose caption embeddings are in the same shard."""
        return self.one_bucket(
            [k for k, s in self.latent_shard.items() if s == shard and self.text_shard[self.text_of[k]] == s]
        )


def remove_images(root: Path, images: list[Any]) -> None:
    for image in images:
        (root / image.path).unlink()
        for ext in (".txt", ".caption"):
            (root / (os.path.splitext(image.path)[0] + ext)).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    base = tmp_path_factory.mktemp("train-data")
    model = build_tiny_model(Family.SDXL, str(base / "model"))
    data = base / "data"
    made = generate_dataset(str(data), count=IMAGES, seed=7, max_side=112)
    per_run = IMAGES // RUNS
    for i in (0, per_run * 2, per_run * 2 + 1):  # one caption in the first run and the last: stored once, in the first
        (data / (os.path.splitext(made[i].path)[0] + ".txt")).write_text(SHARED_CAPTION)
    # the images of the first run, of the first two, and all, in three roots: copies keep size and mtime, so a
    # key (path, bytes, mtime, bucket) is the same whichever root the image was scanned from
    roots = []
    for run in range(1, RUNS):
        root = base / f"data-{run}"
        shutil.copytree(data, root)
        remove_images(root, made[run * per_run :])
        roots.append(root)
    roots.append(data)
    scans = [base / f"scan-{run}" for run in range(1, RUNS + 1)]
    scan_args = ["--resolution", "64", "--alignment", "16", "--allow-oversubscription", "-q"]
    running = [
        start(scan_command([str(root), "--out", str(scan), *scan_args]))
        for root, scan in zip(roots, scans, strict=True)
    ]
    for proc in running:
        finish(proc)

    cache, trimmed = base / "cache", base / "trimmed"
    trim = start(cache_command([scans[-1], "--model", model, "--out", trimmed, "--trim-padding"]))
    shards: list[str] = []
    for run, scan in enumerate(scans):
        summary = finish(start(cache_command([scan, "--model", model, "--out", cache])))
        assert (summary["reused_images"], summary["encoded_images"]) == (run * per_run, per_run), summary
        assert summary["shards_written"] == 1
        manifest = Manifest.load(str(cache))
        assert manifest is not None
        shards += [s["name"] for s in manifest.shards if s["name"] not in shards]
    finish(trim)

    latent_shard: dict[str, str] = {}
    text_shard: dict[str, str] = {}
    text_of: dict[str, str] = {}
    shape_of: dict[str, str] = {}
    for name in shards:
        with h5py.File(cache / "shards" / name, "r") as f:
            for shape, group in f["latents"].items():
                for key, text in zip(group["key"][()], group["text_key"][()], strict=True):
                    latent_shard[key.decode()] = name
                    text_of[key.decode()] = text.decode()
                    shape_of[key.decode()] = shape
            text_shard.update((key.decode(), name) for key in f["text/key"][()])
    assert len(latent_shard) == IMAGES
    return Built(model, data, scans[-1], cache, trimmed, shards, latent_shard, text_shard, text_of, shape_of)


# --- CacheData --------------------------------------------------------------------------------------------------


def assert_same_batch(got: Batch, want: Batch) -> None:
    assert got.keys == want.keys
    for name in ("mean", "logvar", "original_size", "crop_top_left", "pixels"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.text is not None and want.text is not None and sorted(got.text) == sorted(want.text)
    assert all(torch.equal(got.text[n], want.text[n]) for n in got.text)


@integration
def test_cache_data_buckets_and_batches_are_the_cached_arrays_as_float32(built: Built) -> None:
    jobs = jobs_for(read_scan(str(built.scan)), *_recipes(built.cache))
    with CacheData(str(built.cache)) as data, CacheReader(str(built.cache)) as reader:
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
            assert batch.mean.shape == (4, 4, h, w) and batch.logvar is None and batch.pixels is None
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
def test_a_trim_padding_cache_is_zero_padded_to_the_longest_caption_of_the_batch(built: Built) -> None:
    with CacheData(str(built.trimmed)) as data, CacheReader(str(built.trimmed)) as reader:
        with CacheData(str(built.cache)) as untrimmed:  # latent keys do not depend on the text settings
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


def sampler_batches(data: CacheData, batch_size: int = 3, repeats: int = 2) -> list[list[str]]:
    return list(BucketSampler(data.buckets(), repeats, batch_size=batch_size, world_size=1, rank=0, seed=3))


@integration
def test_loader_yields_the_batches_in_order_equal_to_direct_loads(built: Built) -> None:
    with CacheData(str(built.cache)) as data:
        batches = sampler_batches(data)
        assert len(batches) >= 10
        with BatchLoader(data, iter(batches), threads=3, prefetch=4, shard_lookahead=6) as loader:
            got = list(loader)
        assert [b.keys for b in got] == batches
        for batch, keys in zip(got, batches, strict=True):
            assert_same_batch(batch, data.load(keys))
    assert loader_threads() == []


@integration
def test_wait_grows_with_slow_loads_and_stays_small_with_fast_ones(built: Built) -> None:
    with CacheData(str(built.cache)) as data:
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


# --- ImageData ------------------------------------------------------------------------------------------------------


@integration
def test_image_data_gives_the_pixels_of_preprocess_which_encode_to_the_cached_latents(built: Built) -> None:
    scan = read_scan(str(built.scan))
    rows = {row["path"]: row for row in scan.rows}
    data = ImageData(str(built.scan), 8)
    with CacheData(str(built.cache)) as cached:
        reader = cached.reader
        # the same buckets, keyed by path instead of cache key
        by_path = {hw: sorted(reader.latent(k).path for k in keys) for hw, keys in cached.buckets().items()}
        assert data.buckets() == by_path
        latents = {reader.latent(k).path: reader.latent(k) for k in reader.latent_keys()}
    encoders = load_encoders(built.model, device="cpu")
    cropped = 0
    for (h, w), paths in data.buckets().items():
        batch = data.load(paths)
        assert batch.pixels is not None and batch.pixels.dtype == torch.float32
        assert batch.pixels.shape == (len(paths), 3, 8 * h, 8 * w) and batch.mean is None and batch.text is None
        assert batch.captions == [rows[p]["caption"] or "" for p in paths]
        for i, path in enumerate(paths):
            with open(built.data / path, "rb") as f:
                expected = preprocess(f, 8 * w, 8 * h, CropMode.CENTER, "any seed: center crops ignore it")
            assert np.array_equal(batch.pixels[i].numpy(), expected.pixels), path
            assert tuple(batch.original_size[i].tolist()) == expected.original_size == latents[path].original_size
            assert tuple(batch.crop_top_left[i].tolist()) == expected.crop_top_left == latents[path].crop_top_left
            cropped += expected.crop_top_left != (0, 0)
        mean, _ = encoders.encode_images(batch.pixels)
        stored = np.stack([latents[p].mean for p in paths])  # float16
        np.testing.assert_allclose(mean.numpy(), stored.astype(np.float32), rtol=2e-3, atol=2e-3)
    assert cropped > 0, "no image was cropped: the crop offsets were not compared"


@integration
def test_image_data_errors_name_the_scan_or_the_image(built: Built, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"metadata\.parquet"):
        ImageData(str(tmp_path), 8)
    # a copy of the scan over a copy of the images, one of them no longer an image
    data, scan = tmp_path / "data", tmp_path / "scan"
    shutil.copytree(built.data, data)
    shutil.copytree(built.scan, scan)
    summary = json.loads((scan / "summary.json").read_text())
    (scan / "summary.json").write_text(json.dumps({**summary, "root": str(data)}))
    images = ImageData(str(scan), 8)
    paths = next(iter(images.buckets().values()))
    (data / paths[1]).write_bytes(b"not an image any more")
    with pytest.raises(InputError) as raised:
        images.load(paths)
    assert paths[1] in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(InputError, match="not in the scan table"):
        images.load(["no/such.png"])
    with pytest.raises(InputError, match="not a multiple of the VAE's scale factor 32"):
        ImageData(str(scan), 32)


# --- an s3:// cache through node-local copies ---------------------------------------------------------------------


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
