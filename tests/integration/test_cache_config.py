"""A cache built with another config: another model or crop is refused naming what differs, --force replaces it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support.cache_builds import FP32, ONE_BAD, Built, Scanned, error_lines, run_cache
from support.commands import summary_of

from stk.models import Family
from stk.shards import CacheReader, Manifest

pytestmark = pytest.mark.integration


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
