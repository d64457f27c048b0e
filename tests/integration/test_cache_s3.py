"""stk-cache on S3: a cache built to and read back from a real S3 server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from support.cache_builds import ONE_BAD, Built, Scanned, run_cache
from support.commands import summary_of
from support.weed_server import S3_ENV, s3_client

from stk import storage
from stk.models import Family
from stk.shards import CacheReader
from stk.shards.keys import text_key

pytestmark = pytest.mark.integration


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
