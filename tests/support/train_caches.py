"""The cache stk.train.data.loader's tests read: one tiny SDXL model; 24 generated images scanned at 64 px and cached by
stk-cache (subprocesses, as users run them) in three runs of 8 new images each, so the cache has three shards whose
contents are known. Built once a session."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model
from stk.shards import Manifest
from stk.train.data.batch import Batch
from stk.train.data.loader import CacheData
from stk.train.data.sampler import BucketSampler
from support.commands import cache_command, cache_env, scan_command, summary_of

IMAGES, RUNS = 24, 3  # each stk-cache run adds IMAGES // RUNS images in one new shard
SHARED_CAPTION = "a photo of a cat on the mat"


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


@pytest.fixture(scope="session")
def train_data_built(tmp_path_factory: pytest.TempPathFactory) -> Built:
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


def assert_same_batch(got: Batch, want: Batch) -> None:
    assert got.keys == want.keys
    for name in ("mean", "logvar", "original_size", "crop_top_left", "pixels"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.text is not None and want.text is not None and sorted(got.text) == sorted(want.text)
    assert all(torch.equal(got.text[n], want.text[n]) for n in got.text)


def sampler_batches(data: CacheData, batch_size: int = 3, repeats: int = 2) -> list[list[str]]:
    return list(BucketSampler(data.buckets(), repeats, batch_size=batch_size, world_size=1, rank=0, seed=3))
