"""Staging files through the real CLI with an S3 cache: a build whose ranks are killed mid-shard leaves its local
staging files, which the next run removes before it completes (`stk-cache verify` clean)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from support.commands import cache_command, cache_env, scan_command, scan_env, summary_of
from support.processes import kill_cache_ranks_when
from support.shard_records import staged
from support.weed_server import s3_client

from stk.datagen import make_image
from stk.models import Family, build_tiny_model

IMAGES = 120
# Flux latents at 128 px with mean and logvar in float32: 32 KiB a sample, about 30 to a 1 MiB shard.
CACHE_ARGS = ["--dtype", "float32", "--latents", "params", "--shard-size", "1", "--batch-size", "1", "--threads", "1"]


@pytest.mark.integration
def test_killed_s3_build_leaves_staging_files_that_the_next_run_removes(
    s3_server: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    data = tmp_path_factory.mktemp("data")
    for i in range(IMAGES):
        make_image(128, 128, seed=i).save(data / f"im{i:03d}.png")
    scan = tmp_path / "scan"
    scanned = subprocess.run(
        scan_command([data, "--out", scan, "--resolution", "128", "--alignment", "16", "-q"]),
        capture_output=True,
        text=True,
        env=scan_env(),
        timeout=120,
    )
    assert scanned.returncode == 0, scanned.stderr
    model = build_tiny_model(Family.FLUX, str(tmp_path / "flux"))
    bucket = f"stk-staging-{uuid.uuid4().hex[:10]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    cache, work = f"s3://{bucket}/cache", tmp_path / "work"
    args = [scan, "--model", model, "--out", cache, *CACHE_ARGS, "--s3-endpoint-url", s3_server]
    env = {**cache_env(), "STK_CACHE_WORK_DIR": str(work)}

    def both_mid_shard() -> bool:
        return {p.parent.name for p in staged(work)} == {"rank00000", "rank00001"}

    proc = kill_cache_ranks_when(cache_command(args, mpi=2), env, both_mid_shard, "no shard open on both ranks", (0, 1))
    assert proc.returncode != 0
    left = staged(work)
    # both ranks had a shard open when the kill was sent; one may have closed it before the signal landed
    assert left and {p.parent.name for p in left} <= {"rank00000", "rank00001"}, left

    started = time.monotonic()
    rerun = subprocess.run(cache_command(args, mpi=2), capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert time.monotonic() - started < 200
    assert staged(work) == [], "the killed run's staging files are still there"
    assert "left by an earlier run that did not finish" in rerun.stderr  # rank 0 says what it removed
    summary = summary_of(rerun)
    assert summary["encoded_images"] + summary["reused_images"] == IMAGES
    verify = subprocess.run(
        cache_command(["verify", cache, "--scan", scan, "--s3-endpoint-url", s3_server]),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stderr
    assert summary_of(verify)["ok"] is True
