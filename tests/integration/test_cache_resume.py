"""stk-cache interrupted: kill -9 of one rank then a resume that gives the uninterrupted cache, and a second build
on a busy --out refused while the first finishes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.cache_builds import (
    BIG_ARGS,
    BIG_IMAGES,
    BIG_TEXTS,
    FP32,
    ONE_BAD,
    Scanned,
    assert_same_latents,
    error_lines,
    run_cache,
    shard_rows,
)
from support.commands import cache_command, cache_env, summary_of
from support.processes import kill_cache_ranks_when

from stk.models import Family
from stk.shards import CacheReader, Manifest

pytestmark = pytest.mark.integration


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
    proc = kill_cache_ranks_when(
        command, cache_env(), lambda: bool(finished_parts(cache)), "no finished shard", (victim,)
    )
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
