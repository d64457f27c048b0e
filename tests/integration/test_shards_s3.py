"""stk.shards on a real S3 server: an s3:// cache is written, listed and read back."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.shard_records import SHAPES, assert_same_latent, assert_same_text, make_latent, make_text, write
from support.weed_server import S3_ENV, s3_client

from stk import storage
from stk.errors import InputError
from stk.shards import (
    CacheReader,
    Manifest,
    verify,
)

# --- S3 -----------------------------------------------------------------------------------------


@pytest.fixture
def s3_cache(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    storage.configure_s3(s3_server)
    bucket = f"stk-{uuid.uuid4().hex[:12]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/caches/run1"
    storage.configure_s3(None)


@pytest.mark.integration
def test_s3_cache_upload_list_download_and_read(s3_cache: str, tmp_path: Path) -> None:
    latents = [make_latent(i, SHAPES[i % 3], logvar=i % 2 == 0) for i in range(0, 40, 2)]
    latents += [make_latent(i, SHAPES[i % 3], "float16", True) for i in range(1, 40, 2)]
    texts = [make_text(i, 2 + i) for i in range(6)]
    work = tmp_path / "work"
    rank0 = write(s3_cache, latents, texts, shard_size=6000, work_dir=str(work))
    assert len(rank0.infos) >= 3
    assert os.listdir(work) == [], "uploaded shards are not kept in the work dir"
    listed = {info.key for info in storage.list_files(s3_cache)}
    assert listed == {"manifest.json"} | {f"shards/{info.name}" for info in rank0.infos}
    manifest = Manifest.load(s3_cache)
    assert manifest is not None and [s["name"] for s in manifest.shards] == [i.name for i in rank0.infos]

    local = tmp_path / "local"
    biggest = max(info.bytes for info in rank0.infos)
    with CacheReader(s3_cache, local_dir=str(local), max_local_bytes=biggest + 1) as reader:
        assert os.listdir(local) == [], "keys are read with ranged GETs, no shard is fetched on open"
        assert reader.latent_keys() == sorted(s.key for s in latents)
        assert reader.text_keys() == sorted(t.key for t in texts)
        for sample in latents:
            assert_same_latent(reader.latent(sample.key), sample)
            assert sum(p.stat().st_size for p in local.iterdir()) <= biggest + 1, "LRU eviction keeps the limit"
        for text in texts:
            assert_same_text(reader.text(text.key), text)
        assert reader.buckets()[(8, 16)] == sorted(s.key for s in latents if s.mean.shape == (4, 8, 16))

    with CacheReader(s3_cache, local_dir=str(local)) as reader:  # no limit: every shard fetched once, then kept
        for sample in latents:
            reader.latent(sample.key)
        fetched = {p.name: p.stat().st_ino for p in local.iterdir()}
        assert len(fetched) == len(rank0.infos)
    with CacheReader(s3_cache, local_dir=str(local)) as reader:  # a later job reuses the copies
        for sample in latents:
            reader.latent(sample.key)
        assert {p.name: p.stat().st_ino for p in local.iterdir()} == fetched
    with CacheReader(s3_cache) as reader:  # no local_dir: a temp dir, removed on close
        assert_same_latent(reader.latent(latents[0].key), latents[0])
        assert reader._copies is not None
        temp = reader._copies.directory
    assert not os.path.exists(temp)

    assert verify(s3_cache, [s.key for s in latents], [t.key for t in texts]).ok
    with pytest.raises(InputError, match="s3://stk-missing-"):  # one line for people, not boto3's wrapper
        storage.upload_file(str(local / os.listdir(local)[0]), f"s3://stk-missing-{uuid.uuid4().hex[:8]}/x.h5")
    bucket, prefix = storage.s3.split_url(s3_cache)
    storage.s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/shards/{rank0.infos[0].name}")
    report = verify(s3_cache, [s.key for s in latents])
    assert report.missing_shards == [rank0.infos[0].name]
    assert report.missing_latent_keys.astype(str).tolist() == sorted(rank0.infos[0].latent_keys)
