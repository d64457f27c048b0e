"""What the stk-cache end-to-end tests share: stk-cache and stk-scan run as users run them, the tiny models, a scanned
dataset with a PNG that does not decode, one fp32 cache per family (session fixtures, built once), and the caches'
rows read back."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest

from stk.datagen import generate_dataset, make_image
from stk.models import Family, build_tiny_model
from stk.prompts import EMPTY_CAPTION
from stk.shards import CacheReader, Manifest
from support.commands import cache_command, cache_env, scan_env, summary_of

SHARED_CAPTION = "a photo of a cat on the mat"
BAD = "landscapes/corrupt_idat.png"  # passes the header scan, fails to decode
FP32 = ["--dtype", "float32"]
ONE_BAD = ["--max-errors", "1"]  # the scanned dataset's one PNG that does not decode


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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
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


# Flux latents are 16 x 16 x 16 at 128 px: mean and logvar in float32 are 32 KiB a sample, about 32 a 1 MiB shard.
BIG_ARGS = [*FP32, "--latents", "params", "--shard-size", "1", "--batch-size", "1", "--threads", "1"]
BIG_IMAGES = 240
BIG_CAPTIONS = 5
BIG_TEXTS = BIG_CAPTIONS + 1  # and the empty caption


@pytest.fixture(scope="session")
def big_scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("big-data")
    for i in range(BIG_IMAGES):
        make_image(128, 128, seed=i).save(data / f"im{i:04d}.png")
        (data / f"im{i:04d}.txt").write_text(f"caption {i % BIG_CAPTIONS}")
    scan = tmp_path_factory.mktemp("big-scan") / "scan"
    run_scan([data, "--out", scan, "--resolution", "128", "--alignment", "16"])
    return scan


@pytest.fixture(scope="session")
def big_clean(models: dict[Family, str], big_scan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The big dataset cached by one rank, never interrupted."""
    out = tmp_path_factory.mktemp("big-clean") / "cache"
    proc = run_cache([big_scan, "--model", models[Family.FLUX], "--out", out, *BIG_ARGS])
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["encoded_images"] == BIG_IMAGES and summary["captions"] == BIG_TEXTS
    assert summary["shards_written"] >= 6, "shards too large for the kill and repair tests"
    return out
