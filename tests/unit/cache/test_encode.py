"""stk-cache on a scan of several datasets, in process on a tiny SD model on the CPU: each row is encoded with its
dataset's crop (else --crop) under the key that crop gives, and stk-cache verify and stk-train's expected rows find
exactly what was encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.combined_scans import CENTER_OFFSET, STYLE, one_source, write_scan

from stk.cache.inspect import verify_cache
from stk.cache.options import CacheOptions
from stk.cache.pipeline import run_cache
from stk.cluster.world import World
from stk.datagen import make_image
from stk.errors import CacheIncomplete
from stk.images.preprocess import CropMode, preprocess
from stk.models import Family, build_tiny_model
from stk.shards import CacheReader
from stk.shards.config import EncodeSettings
from stk.shards.jobs import ERRORS, expected_columns
from stk.shards.scanned import CHANGED


def test_each_dataset_is_encoded_with_its_own_crop_and_found_by_verify(tmp_path: Path) -> None:
    scan, cache = write_scan(tmp_path), str(tmp_path / "cache")
    model = build_tiny_model(Family.SD, str(tmp_path / "sd"))
    opts = CacheOptions(str(scan), model, cache, device="cpu", batch_size=4, threads=1, settings=EncodeSettings())
    summary = run_cache(opts, World())
    assert (summary.images, summary.encoded_images, summary.errors) == (8, 8, 0)
    with CacheReader(cache) as reader:
        jobs, _ = expected_columns(cache, reader.manifest.cache_config(cache), str(scan))
        assert sorted(reader.latent_keys()) == sorted(job.key for job in jobs.rows())
        crops = {}
        for job in jobs.rows():
            record = reader.latent(job.key)
            assert record.mean.shape[1:] == (job.bucket_height // 8, job.bucket_width // 8)  # its dataset's size
            with open(job.location, "rb") as f:
                wanted = preprocess(f, job.bucket_width, job.bucket_height, job.crop or CropMode.CENTER, job.key)
            assert record.crop_top_left == wanted.crop_top_left, job.path
            crops[job.path] = (job.crop, record.crop_top_left)
    style = [offset for path, (crop, offset) in crops.items() if f"/{STYLE}/" in path]
    assert {crop for path, (crop, _) in crops.items() if f"/{STYLE}/" in path} == {CropMode.RANDOM}
    assert len(style) == 4 and set(style) != {CENTER_OFFSET}  # drawn at random, not --crop's center
    assert verify_cache(cache, str(scan)).ok
    # the same rows keyed without their datasets' crops: the style rows' latents are not there
    with pytest.raises(CacheIncomplete, match=r"4 scan rows have no latent:\n(    .*/style/im\d\.png\n){4}"):
        verify_cache(cache, str(one_source(scan)))


def test_an_image_replaced_after_the_scan_is_an_error_row_not_a_latent(tmp_path: Path) -> None:
    """It was encoded from the new file under the old row's key, silently. Now it is an error row held against
    --max-errors, the row is not expected of the cache (bad input until it is scanned again), and the rest is cached."""
    scan, cache = write_scan(tmp_path), str(tmp_path / "cache")
    replaced = tmp_path / "images" / STYLE / "im0.png"
    make_image(200, 40, seed=9).save(replaced)
    model = build_tiny_model(Family.SD, str(tmp_path / "sd"))
    opts = CacheOptions(
        str(scan), model, cache, device="cpu", batch_size=4, threads=1, settings=EncodeSettings(), max_errors="1"
    )
    summary = run_cache(opts, World())
    assert (summary.images, summary.encoded_images, summary.errors) == (8, 7, 1)
    [row] = [json.loads(line) for line in (tmp_path / "cache" / ERRORS).read_text().splitlines()]
    assert (row["path"], row["kind"]) == (str(replaced), CHANGED)
    assert "when scanned" in row["reason"] and "run stk-scan again" in row["reason"], row["reason"]
    report = verify_cache(cache, str(scan))
    assert report.ok and report.bad_input == 1
