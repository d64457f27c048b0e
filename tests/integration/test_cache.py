"""stk-cache end to end, as users run it (subprocesses, alone or under mpiexec), on tiny random-weight SD, SDXL and
Flux models built once per module, all on the CPU: values against a direct VAE and text-encoder run, deduplicated
captions, 1 rank against 2, kill -9 and resume, refused configs, --trim-padding, verify and repair, S3, info, and
the one-line errors."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from diffusers import AutoencoderKL
from support.commands import cache_command, cache_env, scan_env, summary_of
from support.processes import kill_cache_ranks_when
from support.weed_server import S3_ENV, s3_client

from stk import storage
from stk.datagen import generate_dataset, make_image
from stk.models import Family, build_tiny_model, load_encoders
from stk.preprocess import CropMode, preprocess
from stk.prompts import EMPTY_CAPTION
from stk.scan.reader import read_scan
from stk.shards import CacheReader, Manifest
from stk.shards.jobs import ImageJob, jobs_for
from stk.shards.keys import text_key

pytestmark = pytest.mark.integration

SHARED_CAPTION = "a photo of a cat on the mat"
BAD = "landscapes/corrupt_idat.png"  # passes the header scan, fails to decode
FP32 = ["--dtype", "float32"]
ONE_BAD = ["--max-errors", "1"]  # the scanned dataset's one PNG that does not decode
LATENT_CHANNELS = {Family.SD: 4, Family.SDXL: 4, Family.FLUX: 16}
families = pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)


def run_cache(
    args: list[Any], mpi: int = 0, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    full_env = cache_env()
    full_env.update(env or {})
    return subprocess.run(
        cache_command(args, mpi), capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


def run_scan(args: list[Any]) -> None:
    command = [sys.executable, "-m", "stk.cli.scan", *map(str, args), "--allow-oversubscription", "-q"]
    proc = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if " ERROR " in line]


def jobs_of(cache: Path | str, scan: Path) -> list[ImageJob]:
    """The scan's rows with the keys the cache's own config gives them (no model needed)."""
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    config = manifest.cache_config(str(cache))
    return jobs_for(read_scan(str(scan)), config.latent_recipe(), config.text_recipe())


def shard_rows(cache: Path) -> tuple[int, int]:
    """Latent and text rows over every listed shard, counted with plain h5py (duplicates included)."""
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    latents = texts = 0
    for entry in manifest.shards:
        with h5py.File(cache / "shards" / entry["name"], "r") as f:
            latents += sum(len(group["key"]) for group in f["latents"].values()) if "latents" in f else 0
            texts += len(f["text/key"]) if "text" in f else 0
    return latents, texts


def assert_same_latents(a: CacheReader, b: CacheReader) -> None:
    """Same keys, and bitwise-equal tensors and metadata for every one."""
    assert a.latent_keys() == b.latent_keys()
    for key in a.latent_keys():
        x, y = a.latent(key), b.latent(key)
        assert (x.path, x.text_key, x.original_size, x.crop_top_left) == (
            y.path,
            y.text_key,
            y.original_size,
            y.crop_top_left,
        )
        assert x.mean.dtype == y.mean.dtype and np.array_equal(x.mean, y.mean), x.path
        assert (x.logvar is None) == (y.logvar is None)
        if x.logvar is not None:
            assert y.logvar is not None and np.array_equal(x.logvar, y.logvar), x.path


def corrupt_idat(image_bytes: bytes) -> bytes:
    """A PNG whose compressed pixel data is overwritten in the middle, with the chunk's CRC fixed up: the header,
    the chunk structure and IEND are intact (a header scan accepts it), decoding fails."""
    data = bytearray(image_bytes)
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        if data[pos + 4 : pos + 8] == b"IDAT":
            start = pos + 8
            data[start + length // 3 : start + 2 * length // 3] = b"\xff" * (2 * length // 3 - length // 3)
            data[start + length : start + length + 4] = struct.pack(">I", zlib.crc32(data[pos + 4 : start + length]))
            return bytes(data)
        pos += 12 + length
    raise AssertionError("no IDAT chunk")


# --- module fixtures: models, a scanned dataset, one fp32 cache per family --------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[Family, str]:
    root = tmp_path_factory.mktemp("models")
    return {family: build_tiny_model(family, str(root / family.value)) for family in Family}


@dataclass
class Scanned:
    data: Path
    scan: Path
    rows: list[dict[str, Any]]

    @property
    def good(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row["path"] != BAD]

    @property
    def captions(self) -> set[str]:
        return {row["caption"] for row in self.rows}

    @property
    def texts(self) -> set[str]:
        """What a cache of the scan embeds: its captions and the empty caption (stk-train's --caption-dropout)."""
        return self.captions | {EMPTY_CAPTION}


@pytest.fixture(scope="module")
def scanned(tmp_path_factory: pytest.TempPathFactory) -> Scanned:
    """40 generated images (every format, some EXIF-rotated) where every third captioned one shares a caption, one
    whose name is not UTF-8, plus a PNG that passes the header scan but does not decode; scanned at 64 px, alignment
    16."""
    data = tmp_path_factory.mktemp("data")
    made = generate_dataset(str(data), count=40, seed=4)
    for i, image in enumerate(made):
        if image.caption is not None and i % 3 == 0:
            sidecar = data / (os.path.splitext(image.path)[0] + (".txt" if i % 2 == 0 else ".caption"))
            assert sidecar.exists()
            sidecar.write_text(SHARED_CAPTION + "\n")
    buffer = io.BytesIO()
    make_image(96, 80, seed=99).save(buffer, "PNG")
    (data / BAD).write_bytes(corrupt_idat(buffer.getvalue()))
    folder, name = os.path.split(made[1].path)  # with its caption: renamed to a name that is not UTF-8
    for old in (name, os.path.splitext(name)[0] + ".caption"):
        os.rename(data / folder / old, os.fsencode(data / folder) + b"/\xff\xfe" + old.encode())

    scan = tmp_path_factory.mktemp("scan") / "scan"
    run_scan([data, "--out", scan, "--resolution", "64", "--alignment", "16"])
    rows = pq.read_table(scan / "metadata.parquet").to_pylist()
    assert len(rows) == 41 and BAD in {row["path"] for row in rows}, "the scan must accept the corrupt PNG"
    # stored escaped (stk.storage.names); stk-cache opens the file by it: the cache tests encode it as any other
    renamed = next(row for row in rows if row["path"] == f"{folder}/\\xff\\xfe{name}")
    assert renamed["caption"] == made[1].caption
    assert sum(row["caption"] == SHARED_CAPTION for row in rows) >= 4
    return Scanned(data, scan, rows)


@dataclass
class Built:
    path: Path
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def built(
    models: dict[Family, str], scanned: Scanned, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Family], Built]:
    """built(family) -> a float32 cache of the dataset made by one rank, built on first use."""
    done: dict[Family, Built] = {}

    def get(family: Family) -> Built:
        if family not in done:
            out = tmp_path_factory.mktemp(f"cache-{family.value}") / "cache"
            proc = run_cache([scanned.scan, "--model", models[family], "--out", out, *FP32, *ONE_BAD])
            assert proc.returncode == 0, proc.stderr
            assert "Traceback" not in proc.stderr
            done[family] = Built(out, summary_of(proc))
        return done[family]

    return get


# --- 1. every family: values equal a direct encode ---------------------------------------------------------------


@families
def test_cache_holds_what_the_vae_and_text_encoders_give(
    family: Family, models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built]
) -> None:
    cache = built(family)
    summary = cache.summary
    assert summary["family"] == family.value and summary["ranks"] == 1
    assert summary["images"] == 41 and summary["encoded_images"] == 40 and summary["reused_images"] == 0
    assert summary["errors"] == 1 and summary["shards_written"] >= 1
    errors = [json.loads(line) for line in (cache.path / "errors.jsonl").read_text().splitlines()]
    assert [(e["path"], e["kind"]) for e in errors] == [(BAD, "decode_failed")]

    verify = run_cache(["verify", cache.path, "--scan", scanned.scan])
    assert verify.returncode == 0, verify.stderr
    report = summary_of(verify)
    assert report == {"ok": True, "shards": report["shards"], "latents": 40, "texts": len(scanned.texts),
                      "bad_input": 1}  # fmt: skip

    rows = {row["path"]: row for row in scanned.rows}
    jobs = jobs_of(cache.path, scanned.scan)
    vae = AutoencoderKL.from_pretrained(models[family], subfolder="vae").eval()
    cropped = 0
    with CacheReader(str(cache.path)) as reader:
        assert set(reader.latent_keys()) == {job.key for job in jobs if job.path != BAD}
        for job in jobs:
            if job.path == BAD:
                continue
            sample = reader.latent(job.key)
            assert (sample.path, sample.text_key) == (job.path, job.text_key)
            with open(job.location, "rb") as f:
                pre = preprocess(f, job.bucket_width, job.bucket_height, CropMode.CENTER, job.key)
            with torch.inference_mode():
                expected = vae.encode(torch.from_numpy(pre.pixels)[None]).latent_dist.mean[0].numpy()
            assert sample.mean.dtype == np.float32 and sample.logvar is None
            assert sample.mean.shape == (LATENT_CHANNELS[family], job.bucket_height // 8, job.bucket_width // 8)
            # unscaled and unshifted; batched vs alone on the CPU differs in the last bits only
            np.testing.assert_allclose(sample.mean, expected, rtol=1e-4, atol=1e-5, err_msg=job.path)
            # the size and crop SDXL conditions on: as preprocess gives them; the size is the scan's (EXIF-oriented)
            assert sample.original_size == pre.original_size == (rows[job.path]["height"], rows[job.path]["width"])
            assert sample.crop_top_left == pre.crop_top_left
            cropped += sample.crop_top_left != (0, 0)
        assert cropped > 0, "no image was cropped: the crop offsets were not tested"

        encoders = load_encoders(models[family], device="cpu")
        captions = {job.text_key: job.caption for job in jobs}
        captions[text_key(EMPTY_CAPTION, reader.manifest.cache_config(reader.cache).text_recipe())] = EMPTY_CAPTION
        assert set(reader.text_keys()) == set(captions)
        for key, caption in captions.items():
            stored = reader.text(key)
            (direct,) = encoders.encode_text([caption])
            assert stored.length == direct.length
            assert sorted(stored.arrays) == sorted(direct.arrays) == sorted(encoders.text_outputs)
            for name, array in direct.arrays.items():
                assert stored.arrays[name].dtype == np.float32 and stored.arrays[name].shape == array.shape
                np.testing.assert_allclose(stored.arrays[name], array, rtol=1e-5, atol=1e-5, err_msg=caption)


# --- 2. duplicate captions -----------------------------------------------------------------------------------------


def test_a_shared_caption_is_encoded_and_stored_once(scanned: Scanned, built: Callable[[Family], Built]) -> None:
    cache = built(Family.SD)
    distinct = scanned.texts
    assert len(distinct) < len(scanned.rows)
    assert cache.summary["captions"] == cache.summary["encoded_captions"] == len(distinct)
    jobs = jobs_of(cache.path, scanned.scan)
    with CacheReader(str(cache.path)) as reader:
        assert len(reader.text_keys()) == len(distinct)
        shared = [job for job in jobs if job.caption == SHARED_CAPTION and job.path != BAD]
        assert len(shared) >= 4
        assert len({reader.latent(job.key).text_key for job in shared}) == 1
    assert shard_rows(cache.path) == (40, len(distinct))  # no caption stored twice in any shard


# --- 3. one rank and two -----------------------------------------------------------------------------------------


def test_two_ranks_give_the_same_keys_and_bitwise_equal_tensors(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    one = built(Family.SD)
    out = tmp_path / "two"
    proc = run_cache([scanned.scan, "--model", models[Family.SD], "--out", out, *FP32, *ONE_BAD], mpi=2)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = summary_of(proc)
    assert summary["ranks"] == 2
    for name in ("images", "captions", "encoded_images", "encoded_captions", "errors"):
        assert summary[name] == one.summary[name], name

    manifest = Manifest.load(str(out))
    assert manifest is not None
    assert {entry["name"].split("-")[1] for entry in manifest.shards} == {"r00000", "r00001"}
    assert sorted(os.listdir(out / "shards")) == sorted(entry["name"] for entry in manifest.shards)
    assert (out / "errors.jsonl").read_text() == (one.path / "errors.jsonl").read_text()
    with CacheReader(str(one.path)) as a, CacheReader(str(out)) as b:
        assert_same_latents(a, b)
        assert a.text_keys() == b.text_keys()
        for key in a.text_keys():
            x, y = a.text(key), b.text(key)
            assert x.length == y.length and sorted(x.arrays) == sorted(y.arrays)
            assert all(np.array_equal(x.arrays[n], y.arrays[n]) for n in x.arrays), key


# --- 4. kill -9 and resume (and 7. verify and repair) on a dataset that fills several shards ----------------------

# Flux latents are 16 x 16 x 16 at 128 px: mean and logvar in float32 are 32 KiB a sample, about 32 a 1 MiB shard.
BIG_ARGS = [*FP32, "--latents", "params", "--shard-size", "1", "--batch-size", "1", "--threads", "1"]
BIG_IMAGES = 240
BIG_CAPTIONS = 5
BIG_TEXTS = BIG_CAPTIONS + 1  # and the empty caption


@pytest.fixture(scope="module")
def big_scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("big-data")
    for i in range(BIG_IMAGES):
        make_image(128, 128, seed=i).save(data / f"im{i:04d}.png")
        (data / f"im{i:04d}.txt").write_text(f"caption {i % BIG_CAPTIONS}")
    scan = tmp_path_factory.mktemp("big-scan") / "scan"
    run_scan([data, "--out", scan, "--resolution", "128", "--alignment", "16"])
    return scan


@pytest.fixture(scope="module")
def big_clean(models: dict[Family, str], big_scan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The big dataset cached by one rank, never interrupted."""
    out = tmp_path_factory.mktemp("big-clean") / "cache"
    proc = run_cache([big_scan, "--model", models[Family.FLUX], "--out", out, *BIG_ARGS])
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["encoded_images"] == BIG_IMAGES and summary["captions"] == BIG_TEXTS
    assert summary["shards_written"] >= 6, "shards too large for the kill and repair tests"
    return out


def finished_parts(cache: Path) -> list[dict[str, Any]]:
    """The shards the ranks have recorded as finished so far (CACHE/manifest.d/)."""
    entries: list[dict[str, Any]] = []
    for part in sorted((cache / "manifest.d").glob("*.json")):
        if part.name.startswith("."):
            continue
        with contextlib.suppress(OSError, ValueError):  # replaced (atomically) or removed meanwhile
            entries.extend(json.loads(part.read_text()))
    return entries


def kill_one_rank_after_a_shard(command: list[str], cache: Path, victim: int) -> None:
    proc = kill_cache_ranks_when(command, cache_env(), lambda: bool(finished_parts(cache)), "no finished shard",
                                 (victim,))  # fmt: skip
    assert proc.returncode != 0


def test_kill9_one_rank_then_resume(models: dict[Family, str], big_scan: Path, big_clean: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    args = [big_scan, "--model", models[Family.FLUX], "--out", out, *BIG_ARGS]
    kill_one_rank_after_a_shard(cache_command(args, mpi=2), out, victim=1)
    manifest = Manifest.load(str(out))
    assert manifest is not None and manifest.shards == [], "the killed run listed its shards: it finished"
    parts = finished_parts(out)
    recorded = sum(entry["latents"] for entry in parts)
    assert 0 < recorded < BIG_IMAGES, parts

    proc = run_cache(args, mpi=2)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["reused_images"] == recorded > 0  # every recorded shard kept
    assert summary["encoded_images"] == BIG_IMAGES - recorded > 0  # and only the rest encoded
    verify = run_cache(["verify", out, "--scan", big_scan])
    assert verify.returncode == 0, verify.stderr

    manifest = Manifest.load(str(out))
    assert manifest is not None
    assert not (out / "manifest.d").exists() or not finished_parts(out)
    assert sorted(os.listdir(out / "shards")) == sorted(e["name"] for e in manifest.shards), "unlisted leftovers"
    assert shard_rows(out) == (BIG_IMAGES, BIG_TEXTS)  # no key written twice
    with CacheReader(str(big_clean)) as clean, CacheReader(str(out)) as resumed:
        assert len(resumed.latent_keys()) == BIG_IMAGES and len(resumed.text_keys()) == BIG_TEXTS
        assert_same_latents(clean, resumed)  # batches of one image: bitwise equal to the clean run
        assert clean.text_keys() == resumed.text_keys()


def test_verify_names_a_deleted_and_a_corrupted_shard_and_repair_then_rebuild_restores_it(
    models: dict[Family, str], big_scan: Path, big_clean: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(big_clean, cache)
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    entries = {entry["name"]: entry for entry in manifest.shards}
    deleted, corrupted = list(entries)[1], list(entries)[3]
    (cache / "shards" / deleted).unlink()
    damaged = cache / "shards" / corrupted
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    proc = run_cache(["verify", cache, "--scan", big_scan])
    assert proc.returncode == 6, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert f"missing shard: {deleted}" in proc.stderr
    assert f"damaged shard: {corrupted}: sha256" in proc.stderr

    repair = run_cache(["verify", cache, "--repair"])
    assert repair.returncode == 6, repair.stderr
    assert "unlisted and deleted 2 shard(s)" in repair.stderr
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    assert sorted(e["name"] for e in manifest.shards) == sorted(set(entries) - {deleted, corrupted})
    assert not damaged.exists()

    lost = entries[deleted]["latents"] + entries[corrupted]["latents"]
    rebuild = run_cache([big_scan, "--model", models[Family.FLUX], "--out", cache, *BIG_ARGS])
    assert rebuild.returncode == 0, rebuild.stderr
    summary = summary_of(rebuild)
    assert (summary["reused_images"], summary["encoded_images"]) == (BIG_IMAGES - lost, lost)
    verify = run_cache(["verify", cache, "--scan", big_scan])
    assert verify.returncode == 0, verify.stderr
    with CacheReader(str(big_clean)) as clean, CacheReader(str(cache)) as restored:
        assert_same_latents(clean, restored)
        assert clean.text_keys() == restored.text_keys()


def test_an_invalid_manifest_is_rebuilt_by_repair_keeping_every_shard_and_the_model_via_a_symlink_reuses_them(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    """A truncated manifest.json: every command that reads it says so in one line (exit 6) with the repair;
    `verify --repair` rebuilds it from the shards (they carry its header), so the cache verifies and reads back
    every sample, and stk-cache with the same model through a symlink finds everything cached."""
    original = built(Family.SD)
    cache = tmp_path / "cache"
    shutil.copytree(original.path, cache)
    whole = (cache / "manifest.json").read_bytes()
    (cache / "manifest.json").write_bytes(whole[: len(whole) // 2])
    for args in (["verify", cache], ["info", cache]):
        proc = run_cache(args)
        assert proc.returncode == 6, proc.stderr
        (line,) = error_lines(proc)
        assert "Traceback" not in proc.stderr and f"{cache}/manifest.json is damaged (not JSON" in line
        assert f"`stk-cache verify {cache} --repair`" in line

    repair = run_cache(["verify", cache, "--repair"])
    assert repair.returncode == 0, repair.stderr
    assert "Traceback" not in repair.stderr and summary_of(repair)["ok"]
    assert sorted(os.listdir(cache / "shards")) == sorted(os.listdir(original.path / "shards"))
    rebuilt, before = Manifest.load(str(cache)), Manifest.load(str(original.path))
    assert rebuilt is not None and before is not None and rebuilt.header() == before.header()
    assert sorted(rebuilt.shards, key=lambda s: s["name"]) == sorted(before.shards, key=lambda s: s["name"])
    assert run_cache(["verify", cache, "--scan", scanned.scan]).returncode == 0
    with CacheReader(str(original.path)) as old, CacheReader(str(cache)) as new:
        assert_same_latents(old, new)
        assert old.text_keys() == new.text_keys()
        for key in old.text_keys():
            assert all(np.array_equal(a, new.text(key).arrays[n]) for n, a in old.text(key).arrays.items())

    link = tmp_path / "same-model"
    link.symlink_to(models[Family.SD])
    again = run_cache([scanned.scan, "--model", link, "--out", cache, *FP32, *ONE_BAD])
    assert again.returncode == 0, again.stderr
    summary = summary_of(again)
    assert (summary["encoded_images"], summary["encoded_captions"]) == (0, 0), summary
    assert summary["reused_images"] == len(scanned.good)
    assert sorted(os.listdir(cache / "shards")) == sorted(os.listdir(original.path / "shards"))


def test_a_second_build_on_a_busy_out_is_refused_and_the_first_finishes(
    models: dict[Family, str], scanned: Scanned, tmp_path: Path
) -> None:
    out = tmp_path / "cache"
    lease = out / ".stk-cache.lease"
    args = [scanned.scan, "--model", models[Family.SD], "--out", out, *FP32, *ONE_BAD]
    env = cache_env()
    first = subprocess.Popen(cache_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not lease.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.exists(), "the first run never took the lease"
        first.send_signal(signal.SIGSTOP)  # held busy while the second starts (the tiny dataset takes seconds)
        try:
            second = run_cache(args)
        finally:
            first.send_signal(signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 7, second.stderr
    (line,) = error_lines(second)
    assert "Traceback" not in second.stderr and second.stdout == ""
    assert f"--out {out} is in use by another stk-cache run (host {socket.gethostname()}, pid {first.pid}" in line
    assert first.returncode == 0, stderr
    assert json.loads(stdout)["encoded_images"] == len(scanned.good)
    assert not lease.exists()
    assert run_cache(["verify", out, "--scan", scanned.scan]).returncode == 0


# --- 5. another config ---------------------------------------------------------------------------------------------


def differing(proc: subprocess.CompletedProcess[str]) -> set[str]:
    """The config parts a refusal names: '... (a, b differ) ...'."""
    match = re.search(r"\(([a-z_, ]+) differ\)", proc.stderr)
    assert match, proc.stderr
    return set(match.group(1).split(", "))


def test_another_model_or_crop_is_refused_and_force_replaces_the_cache(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    original = built(Family.SD)
    cache = tmp_path / "cache"
    shutil.copytree(original.path, cache)
    manifest_before = (cache / "manifest.json").read_bytes()
    shards_before = sorted(os.listdir(cache / "shards"))
    base = [scanned.scan, "--out", cache, *FP32, *ONE_BAD]

    other_model = run_cache([*base, "--model", models[Family.FLUX]])
    assert other_model.returncode == 3, other_model.stderr
    assert {"family", "model"} <= differing(other_model)
    other_crop = run_cache([*base, "--model", models[Family.SD], "--crop", "random"])
    assert other_crop.returncode == 3, other_crop.stderr
    assert differing(other_crop) == {"latents"}
    for proc in (other_model, other_crop):
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        assert len(error_lines(proc)) == 1 and "--force" in error_lines(proc)[0]
    assert (cache / "manifest.json").read_bytes() == manifest_before
    assert sorted(os.listdir(cache / "shards")) == shards_before

    forced = run_cache([*base, "--model", models[Family.SD], "--crop", "random", "--force"])
    assert forced.returncode == 0, forced.stderr
    summary = summary_of(forced)
    assert (summary["reused_images"], summary["encoded_images"]) == (0, 40)
    manifest = Manifest.load(str(cache))
    assert manifest is not None and manifest.config["latents"]["crop"] == "random"
    assert sorted(os.listdir(cache / "shards")) == sorted(e["name"] for e in manifest.shards)
    assert not set(shards_before) & set(os.listdir(cache / "shards")), "old shards left behind"
    verify = run_cache(["verify", cache, "--scan", scanned.scan])
    assert verify.returncode == 0, verify.stderr

    with CacheReader(str(original.path)) as old, CacheReader(str(cache)) as new:
        old_crops = {old.latent(k).path: old.latent(k).crop_top_left for k in old.latent_keys()}
        new_crops = {new.latent(k).path: new.latent(k).crop_top_left for k in new.latent_keys()}
    assert old_crops.keys() == new_crops.keys()
    assert any(old_crops[p] != new_crops[p] for p in old_crops), "--crop random was not applied"


# --- 6. --trim-padding ---------------------------------------------------------------------------------------------


def test_trim_padding_stores_the_real_tokens_of_the_untrimmed_encoding(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    full = built(Family.SDXL)
    out = tmp_path / "trimmed"
    proc = run_cache([scanned.scan, "--model", models[Family.SDXL], "--out", out, *FP32, *ONE_BAD, "--trim-padding"])
    assert proc.returncode == 0, proc.stderr

    trimmed_manifest, full_manifest = Manifest.load(str(out)), Manifest.load(str(full.path))
    assert trimmed_manifest is not None and full_manifest is not None
    trimmed_recipe = trimmed_manifest.cache_config(str(out)).text_recipe()
    full_recipe = full_manifest.cache_config(str(full.path)).text_recipe()
    assert trimmed_recipe != full_recipe
    with CacheReader(str(out)) as trimmed, CacheReader(str(full.path)) as padded:
        assert trimmed.latent_keys() == padded.latent_keys()  # latents do not depend on the text settings
        assert len(trimmed.text_keys()) == len(scanned.texts)
        for caption in sorted(scanned.texts):
            short, long = trimmed.text(text_key(caption, trimmed_recipe)), padded.text(text_key(caption, full_recipe))
            assert short.length == long.length < 77, caption
            assert long.arrays["prompt_embeds"].shape == (77, 96)
            assert short.arrays["prompt_embeds"].shape == (short.length, 96)
            np.testing.assert_allclose(
                short.arrays["prompt_embeds"], long.arrays["prompt_embeds"][: short.length], rtol=1e-6, atol=1e-6
            )
            # pooled vectors are not sequences: stored whole
            assert short.arrays["pooled_prompt_embeds"].shape == (64,)
            np.testing.assert_allclose(
                short.arrays["pooled_prompt_embeds"], long.arrays["pooled_prompt_embeds"], rtol=1e-6, atol=1e-6
            )


# --- 8. S3 ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def s3_in_process(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process's stk.storage pointed at the test S3 server (dummy credentials from the environment)."""
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    storage.configure_s3(s3_server)
    try:
        yield s3_server
    finally:
        storage.configure_s3(None)


def test_s3_cache_round_trip(
    models: dict[Family, str],
    scanned: Scanned,
    built: Callable[[Family], Built],
    s3_in_process: str,
    tmp_path: Path,
) -> None:
    endpoint = s3_in_process
    client = s3_client(endpoint)
    bucket = f"stk-cache-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/cache"
    work = tmp_path / "work"
    endpoint_args = ["--s3-endpoint-url", endpoint]

    # the default storage dtype, float16
    proc = run_cache(
        [scanned.scan, "--model", models[Family.SD], "--out", url, *ONE_BAD, *endpoint_args],
        env={"STK_CACHE_WORK_DIR": str(work)},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert (summary["encoded_images"], summary["errors"]) == (40, 1)
    assert work.is_dir() and not [p for p in work.rglob("*") if p.is_file()], "staged shards left behind"
    assert sorted(os.listdir(tmp_path)) == ["work"], "the build wrote locally outside its work dir"
    listed = client.list_objects_v2(Bucket=bucket, Prefix="cache/")
    keys = {obj["Key"] for obj in listed.get("Contents", [])}
    assert {"cache/manifest.json", "cache/errors.jsonl"} <= keys
    assert len([k for k in keys if k.startswith("cache/shards/") and k.endswith(".h5")]) == summary["shards_written"]

    info = run_cache(["info", url, *endpoint_args])
    assert info.returncode == 0, info.stderr
    facts = summary_of(info)
    assert (facts["latents"], facts["texts"], facts["family"]) == (40, len(scanned.texts), "sd")
    verify = run_cache(["verify", url, "--scan", scanned.scan, *endpoint_args])
    assert verify.returncode == 0, verify.stderr
    assert summary_of(verify)["ok"] is True

    reference = built(Family.SD)  # float32, local
    with CacheReader(url, local_dir=str(tmp_path / "copies")) as remote, CacheReader(str(reference.path)) as local:
        assert len(remote.latent_keys()) == 40
        by_path = {local.latent(k).path: local.latent(k) for k in local.latent_keys()}
        for key in remote.latent_keys():
            sample = remote.latent(key)
            expected = by_path[sample.path]
            assert sample.mean.dtype == np.float16
            np.testing.assert_allclose(sample.mean.astype(np.float32), expected.mean, rtol=2e-3, atol=1e-4)
            assert (sample.original_size, sample.crop_top_left) == (expected.original_size, expected.crop_top_left)
        remote_recipe = remote.manifest.cache_config(remote.cache).text_recipe()
        local_recipe = local.manifest.cache_config(local.cache).text_recipe()
        for caption in scanned.captions:
            text = remote.text(text_key(caption, remote_recipe))
            expected_text = local.text(text_key(caption, local_recipe))
            assert text.length == expected_text.length
            embeds = text.arrays["prompt_embeds"]
            assert embeds.dtype == np.float16
            np.testing.assert_allclose(
                embeds.astype(np.float32), expected_text.arrays["prompt_embeds"], rtol=2e-3, atol=1e-3
            )


# --- 9. info -------------------------------------------------------------------------------------------------------


def test_info_reports_samples_buckets_bytes_and_compression(scanned: Scanned, built: Callable[[Family], Built]) -> None:
    cache = built(Family.SD)
    proc = run_cache(["info", cache.path])
    assert proc.returncode == 0, proc.stderr
    info = summary_of(proc)
    good = scanned.good
    assert (info["family"], info["latents"], info["texts"]) == ("sd", len(good), len(scanned.texts))
    assert info["buckets"] == dict(Counter(f"{r['bucket_height'] // 8}x{r['bucket_width'] // 8}" for r in good))
    shard_files = list((cache.path / "shards").glob("*.h5"))
    assert info["shards"] == len(shard_files)
    assert info["bytes"] == sum(p.stat().st_size for p in shard_files)
    # float32: a (4, h/8, w/8) latent per image, a (77, 32) embedding per distinct caption
    raw = sum(4 * 4 * (r["bucket_height"] // 8) * (r["bucket_width"] // 8) for r in good)
    raw += len(scanned.texts) * 77 * 32 * 4
    assert info["raw_bytes"] == raw
    assert info["compression_ratio"] == round(raw / info["bytes"], 3)
    assert info["scaling_factor"] == pytest.approx(0.18215) and info["shift_factor"] is None
    assert info["settings"]["latents"]["dtype"] == info["settings"]["text"]["dtype"] == "float32"


# --- 10. one-line errors --------------------------------------------------------------------------------------------


def test_a_missing_scan_a_directory_that_is_no_model_or_an_empty_prompt_file_is_one_line_and_exit_3(
    models: dict[Family, str], scanned: Scanned, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-scan"
    proc = run_cache([missing, "--model", models[Family.SD], "--out", tmp_path / "cache1"])
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = error_lines(proc)
    assert len(lines) == 1 and str(missing) in lines[0], proc.stderr
    assert not (tmp_path / "cache1").exists()

    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    proc = run_cache([scanned.scan, "--model", not_a_model, "--out", tmp_path / "cache2"])
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = error_lines(proc)
    assert len(lines) == 1 and "model_index.json" in lines[0] and str(not_a_model) in lines[0], proc.stderr
    assert not (tmp_path / "cache2").exists()

    empty = tmp_path / "prompts.txt"
    empty.write_text("\n \n")
    proc = run_cache([scanned.scan, "--model", models[Family.SD], "--out", tmp_path / "cache3",
                      "--validation-prompts", empty])  # fmt: skip
    lines = error_lines(proc)
    assert proc.returncode == 3 and len(lines) == 1 and f"{empty}: no prompts in it (one per line)" in lines[0]
    assert not (tmp_path / "cache3").exists()


def test_a_truncated_scan_table_a_missing_or_an_empty_shard_are_exit_6_naming_the_file_and_the_fix(
    scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    """Damage is exit 6 in one line naming the file and what rebuilds it; found before any model loads (the model
    given here is no model)."""
    scan = tmp_path / "scan"
    shutil.copytree(scanned.scan, scan)
    table = scan / "metadata.parquet"
    table.write_bytes(table.read_bytes()[:200])
    proc = run_cache([scan, "--model", tmp_path / "no-model", "--out", tmp_path / "out"])
    assert proc.returncode == 6, proc.stderr
    (line,) = error_lines(proc)
    assert "Traceback" not in proc.stderr and f"{table} is damaged (not a readable parquet file" in line
    assert f"`stk-scan {scanned.data} --out {scan}`" in line
    assert not (tmp_path / "out").exists()
    proc = run_cache(["verify", built(Family.SD).path, "--scan", scan])
    assert proc.returncode == 6 and f"{table} is damaged" in error_lines(proc)[0], proc.stderr
    proc = run_cache([tmp_path, "--model", tmp_path / "no-model", "--out", tmp_path / "out"])
    assert proc.returncode == 3 and "not an stk-scan output directory" in error_lines(proc)[0], proc.stderr

    for damage in ("missing", "empty"):
        cache = tmp_path / f"cache-{damage}"
        shutil.copytree(built(Family.SD).path, cache)
        shard = sorted((cache / "shards").iterdir())[0]
        shard.unlink() if damage == "missing" else shard.write_bytes(b"")
        proc = run_cache(["info", cache])
        assert proc.returncode == 6, proc.stderr
        (line,) = error_lines(proc)
        assert "Traceback" not in proc.stderr and f"shard {shard} is damaged" in line
        assert f"`stk-cache verify {cache} --repair`" in line


@contextlib.contextmanager
def web_server() -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 (HTML pages, 404 and 501 answers): not S3."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("endpoint", ["missing-bucket", "unresolvable-host", "not-s3"])
def test_a_wrong_bucket_or_endpoint_is_one_line_and_exit_3_before_the_model_loads(
    scanned: Scanned, s3_server: str, tmp_path: Path, endpoint: str
) -> None:
    """The model given is no model: the storage error comes first, so no model was loaded."""
    bucket = f"stk-missing-{uuid.uuid4().hex[:10]}"
    with contextlib.ExitStack() as stack:
        url = {
            "missing-bucket": s3_server,
            "unresolvable-host": "http://no-such-host.invalid:8333",
            "not-s3": stack.enter_context(web_server()) if endpoint == "not-s3" else "",
        }[endpoint]
        started = time.monotonic()
        proc = run_cache([scanned.scan, "--model", tmp_path / "no-model", "--out", f"s3://{bucket}/cache",
                          "--s3-endpoint-url", url])  # fmt: skip
        seconds = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = error_lines(proc)
    assert url in line and "no-model" not in line, line
    assert {
        "missing-bucket": f"S3 bucket '{bucket}' does not exist",
        "unresolvable-host": "the host name no-such-host.invalid does not resolve",
        "not-s3": "does not answer as S3 (HTTP 404 to ListObjectsV2",
    }[endpoint] in line, line
    assert seconds < 60, "retried as an outage"
