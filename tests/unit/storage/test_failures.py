"""A disk that fails under stk-cache, stk-scan and stk-train, as users run them: a full disk (a small tmpfs), a file
system remounted read-only, and a directory the user may not write (root without CAP_DAC_OVERRIDE, through setpriv).
Each ends with one line naming the path and the documented exit code (69 infrastructure, 3 input), no traceback, a
manifest that lists only finished shards, and a rerun that completes once the disk is fixed (`stk-cache verify`
clean). The mapping itself (errno, or HDF5's message) is checked first, without a disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.bad_inputs import without_dac_override
from support.commands import (
    Mount,
    cache_command,
    cache_env,
    one_error,
    scan_command,
    scan_env,
    summary_of,
    train_command,
    train_env,
)

from stk.datagen import make_image
from stk.errors import InfraError, InputError
from stk.models import Family, build_tiny_model
from stk.shards import Manifest
from stk.storage.failures import as_stk_error

IMAGES = 60
# Flux latents at 128 px with mean and logvar in float32: 32 KiB a sample, about 30 to a 1 MiB shard.
CACHE_ARGS = ["--dtype", "float32", "--latents", "params", "--shard-size", "1", "--batch-size", "1", "--threads", "1"]

# --- the mapping, without a disk -------------------------------------------------------------------------------------


def test_errnos_map_to_infra_or_input_with_the_path() -> None:
    full = as_stk_error(OSError(errno.ENOSPC, "No space left on device", "/d/x"))
    assert isinstance(full, InfraError) and "/d/x" in str(full) and "no space left" in str(full)
    read_only = as_stk_error(OSError(errno.EROFS, "Read-only file system"), path="/d/manifest.json")
    assert isinstance(read_only, InfraError) and "/d/manifest.json" in str(read_only)
    denied = as_stk_error(PermissionError(errno.EACCES, "Permission denied", "/d/y"), where="rank 1 on n1")
    assert isinstance(denied, InputError) and str(denied).startswith("rank 1 on n1: permission denied: /d/y")
    during_a_save = as_stk_error(PermissionError(errno.EACCES, "Permission denied", "/o/c"), saving=True)
    assert isinstance(during_a_save, InfraError) and "permission denied: /o/c" in str(during_a_save)  # requeued
    assert as_stk_error(FileNotFoundError(errno.ENOENT, "No such file", "/d/z")) is None
    assert as_stk_error(ValueError("no errno here")) is None


def test_hdf5_messages_give_their_errno_and_file_name_on_one_line() -> None:
    # the text h5py raises (as RuntimeError or OSError) when HDF5's write fails on a full disk
    text = (
        "Can't decrement id ref count (file write failed: time = Mon Nov 23 12:12:00 2026\n, filename = "
        "'/c/shards/a-r00000-00000.h5.tmp', file descriptor = 3, errno = 28, error message = 'No space left on "
        "device', buf = 0x5, total write size = 1872, bytes this sub-write = 1872, offset = 262144)"
    )
    for exc in (RuntimeError(text), OSError(5, text)):  # h5py's OSError may carry another errno than the cause
        error = as_stk_error(exc)
        assert isinstance(error, InfraError), exc
        assert "\n" not in str(error) and "/c/shards/a-r00000-00000.h5.tmp" in str(error)
    # safetensors (Rust) and shutil.copytree put the errno in their text only
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    copied = shutil.Error([("/m/unet/w", "/o/final/unet/w", "[Errno 30] Read-only file system: '/o/final/unet/w'")])
    assert isinstance(as_stk_error(rust, path="/o/final"), InfraError)
    assert "read-only" in str(as_stk_error(copied, path="/o/final"))


# --- through the CLIs -----------------------------------------------------------------------------------------------


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.FLUX, str(tmp_path_factory.mktemp("model") / "flux"))


@pytest.fixture(scope="module")
def images_scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("data")
    for i in range(IMAGES):
        make_image(128, 128, seed=i).save(data / f"im{i:03d}.png")
    out = tmp_path_factory.mktemp("scan") / "scan"
    proc = run([data, "--out", out, "--resolution", "128", "--alignment", "16", "-q"], command=scan_command)
    assert proc.returncode == 0, proc.stderr
    return out


def run(
    args: list[Any], mpi: int = 0, command: Callable[..., list[str]] = cache_command, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = cache_env() if command is cache_command else scan_env()
    full = [*prefix, *command(args, mpi)]
    return subprocess.run(full, capture_output=True, text=True, env=env, timeout=300)


def assert_consistent(cache: Path) -> None:
    """Every listed shard is there, whole; no staging file is left behind by the run that failed."""
    manifest = Manifest.load(str(cache))
    listed = {entry["name"] for entry in manifest.shards} if manifest else set()
    present = set(os.listdir(cache / "shards")) if (cache / "shards").is_dir() else set()
    assert listed <= present, listed - present
    assert not [name for name in present if name.endswith(".tmp")], present


def verify_clean(cache: Path, scan: Path) -> None:
    proc = run(["verify", cache, "--scan", scan])
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["ok"] is True


def test_a_full_disk_under_two_ranks_is_exit_69_naming_the_shard_and_a_rerun_completes(
    flux: str, images_scan: Path, mount: Mount
) -> None:
    disk = mount("disk", "size=3m")  # room for a shard or two of the ~1.2 MiB x 4 this cache needs
    cache = disk / "cache"
    args = [images_scan, "--model", flux, "--out", cache, *CACHE_ARGS]
    started = time.monotonic()
    proc = run(args, mpi=2)
    seconds = time.monotonic() - started
    line = one_error(proc, 69, "no space left on the device", str(cache / "shards"), "rerun")
    assert line.split(" ERROR ", 1)[1].startswith("rank "), line  # which rank, on which node
    assert seconds < 150, f"{seconds:.0f} s to give up on a full disk"
    assert proc.stdout == ""
    assert_consistent(cache)

    remount(disk, "size=64m")
    rerun = run(args, mpi=2)
    assert rerun.returncode == 0, rerun.stderr
    summary = summary_of(rerun)
    assert summary["encoded_images"] + summary["reused_images"] == IMAGES and summary["errors"] == 0
    verify_clean(cache, images_scan)
    assert_consistent(cache)


def test_a_read_only_file_system_is_exit_69_and_a_rerun_after_remounting_completes(
    flux: str, images_scan: Path, mount: Mount
) -> None:
    disk = mount("disk", "size=64m")
    cache = disk / "cache"
    remount(disk, "ro")
    args = [images_scan, "--model", flux, "--out", cache, *CACHE_ARGS]
    proc = run(args)
    one_error(proc, 69, "read-only", str(cache))
    assert proc.stdout == "" and not cache.exists()

    remount(disk, "rw")
    rerun = run(args)
    assert rerun.returncode == 0, rerun.stderr
    assert summary_of(rerun)["encoded_images"] == IMAGES
    verify_clean(cache, images_scan)


def test_permission_denied_is_exit_3_naming_the_path(flux: str, images_scan: Path, tmp_path: Path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    cache = parent / "cache"
    args = [images_scan, "--model", flux, "--out", cache, *CACHE_ARGS]
    proc = run(args, prefix=without_dac_override())
    one_error(proc, 3, "permission denied", str(cache))
    assert proc.stdout == "" and not cache.exists()

    parent.chmod(0o755)
    rerun = run(args, prefix=without_dac_override())
    assert rerun.returncode == 0, rerun.stderr
    verify_clean(cache, images_scan)


def test_stk_scan_on_a_full_disk_is_exit_69_naming_its_output_and_a_rerun_completes(
    images_scan: Path, mount: Mount, tmp_path: Path
) -> None:
    disk = mount("disk", "size=256k")
    (disk / "filler").write_bytes(b"\0" * (256 * 1024 - 4096 * 2))  # what is left: less than the scan's outputs
    data = json.loads((images_scan / "summary.json").read_text())["root"]
    out = disk / "scan"
    args = [data, "--out", out, "--resolution", "128", "--alignment", "16"]
    proc = run(args, mpi=2, command=scan_command)
    one_error(proc, 69, "no space left on the device", str(out))
    assert proc.stdout == ""

    (disk / "filler").unlink()
    rerun = run(args, mpi=2, command=scan_command)
    assert rerun.returncode == 0, rerun.stderr
    assert summary_of(rerun)["images"] == IMAGES


def test_stk_train_on_a_full_output_disk_is_exit_69_naming_the_checkpoint_and_a_rerun_completes(
    setups: Callable[[Family], tuple[str, Path]], mount: Mount
) -> None:
    """One rank: that every rank stops when one of them fails is the rank-failure tests' concern."""
    model, cache = setups(Family.SD)
    disk = mount("disk", "size=2m")  # metrics fit; the first checkpoint (weights and Adam state) does not
    out = disk / "run"
    args = [
        "--cache",
        cache,
        "--model",
        model,
        "--output-dir",
        out,
        "--max-steps",
        "4",
        "--checkpoint-every",
        "2",
        "--batch-size",
        "2",
        "--precision",
        "fp32",
        "-q",
    ]
    started = time.monotonic()
    proc = subprocess.run(train_command(args), capture_output=True, text=True, env=train_env(), timeout=300)
    seconds = time.monotonic() - started
    one_error(proc, 69, "no space left on the device", str(out / "checkpoints" / "step-00000002"))
    assert seconds < 200, f"{seconds:.0f} s"
    assert not (out / "checkpoints" / "latest").exists()  # no torn checkpoint is pointed at

    remount(disk, "size=256m")
    rerun = subprocess.run(train_command(args), capture_output=True, text=True, env=train_env(), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps  # each step once
    assert (out / "final" / "model_index.json").exists()
