"""stk.train.data.loader's ImageData against stk.images.preprocess and the cached latents (on-the-fly == cached), and
its errors naming the scan or the image.

On the session's three-shard SDXL cache (support.train_caches)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.train_caches import Built

from stk.errors import InputError
from stk.images.preprocess import CropMode, preprocess
from stk.models import load_encoders
from stk.scan.reader import read_scan
from stk.train.data.loader import CacheData, ImageData

integration = pytest.mark.integration


@integration
def test_image_data_gives_the_pixels_of_preprocess_which_encode_to_the_cached_latents(train_data_built: Built) -> None:
    scan = read_scan(str(train_data_built.scan))
    rows = {row["path"]: row for row in scan.rows}
    data = ImageData(str(train_data_built.scan), 8)
    with CacheData(str(train_data_built.cache)) as cached:
        reader = cached.reader
        # the same buckets, keyed by path instead of cache key
        by_path = {hw: sorted(reader.latent(k).path for k in keys) for hw, keys in cached.buckets().items()}
        assert data.buckets() == by_path
        latents = {reader.latent(k).path: reader.latent(k) for k in reader.latent_keys()}
    encoders = load_encoders(train_data_built.model, device="cpu")
    cropped = 0
    for (h, w), paths in data.buckets().items():
        batch = data.load(paths)
        assert batch.pixels is not None and batch.pixels.dtype == torch.float32
        assert batch.pixels.shape == (len(paths), 3, 8 * h, 8 * w) and batch.mean is None and batch.text is None
        assert batch.captions == [rows[p]["caption"] or "" for p in paths]
        for i, path in enumerate(paths):
            with open(train_data_built.data / path, "rb") as f:
                expected = preprocess(f, 8 * w, 8 * h, CropMode.CENTER, "any seed: center crops ignore it")
            assert np.array_equal(batch.pixels[i].numpy(), expected.pixels), path
            assert tuple(batch.original_size[i].tolist()) == expected.original_size == latents[path].original_size
            assert tuple(batch.crop_top_left[i].tolist()) == expected.crop_top_left == latents[path].crop_top_left
            cropped += expected.crop_top_left != (0, 0)
        mean, _ = encoders.encode_images(batch.pixels)
        stored = np.stack([latents[p].mean for p in paths])  # float16
        np.testing.assert_allclose(mean.numpy(), stored.astype(np.float32), rtol=2e-3, atol=2e-3)
    assert cropped > 0, "no image was cropped: the crop offsets were not compared"


@integration
def test_image_data_errors_name_the_scan_or_the_image(train_data_built: Built, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"metadata\.parquet"):
        ImageData(str(tmp_path), 8)
    # a copy of the scan over a copy of the images, one of them no longer an image
    data, scan = tmp_path / "data", tmp_path / "scan"
    shutil.copytree(train_data_built.data, data)
    shutil.copytree(train_data_built.scan, scan)
    summary = json.loads((scan / "summary.json").read_text())
    (scan / "summary.json").write_text(json.dumps({**summary, "root": str(data)}))
    images = ImageData(str(scan), 8)
    paths = next(iter(images.buckets().values()))
    broken = data / paths[1]
    before = broken.stat()  # the same size and mtime: the scan's row still matches it, and the decoder fails
    broken.write_bytes(b"not an image any more".ljust(before.st_size, b"!"))
    os.utime(broken, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(InputError) as raised:
        images.load(paths)
    assert paths[1] in str(raised.value) and "cannot decode" in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(InputError, match="not in the scan table"):
        images.load(["no/such.png"])
    with pytest.raises(InputError, match="not a multiple of the VAE's scale factor 32"):
        ImageData(str(scan), 32)
