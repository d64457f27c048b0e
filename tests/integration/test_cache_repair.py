"""stk-cache verify and --repair: deleted and corrupted shards named and restored, an invalid manifest rebuilt from
the shards."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.cache_builds import (
    BIG_ARGS,
    BIG_IMAGES,
    FP32,
    ONE_BAD,
    Built,
    Scanned,
    assert_same_latents,
    error_lines,
    run_cache,
)
from support.commands import summary_of

from stk.models import Family
from stk.shards import CacheReader, Manifest

pytestmark = pytest.mark.integration


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
