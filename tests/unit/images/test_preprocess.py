"""Decode, orient, resize to cover, crop: what the VAE sees."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from support.bad_inputs import raising, unimplemented_dds

from stk.datagen import make_image, save
from stk.errors import InfraError
from stk.images import preprocess as preprocess_module
from stk.images.preprocess import CropMode, PreprocessError, preprocess


def _run(path: Path, width: int, height: int, crop: CropMode = CropMode.CENTER, seed: str = "k"):
    with open(path, "rb") as f:
        return preprocess(f, width, height, crop, seed)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [1, 6, 8])
def test_output_fills_the_bucket_and_reports_the_oriented_size(tmp_path: Path, fmt: str, orientation: int) -> None:
    path = tmp_path / f"img.{fmt.lower()}"
    save(make_image(300, 200), str(path), fmt, orientation)  # displayed as 300 wide, 200 high
    result = _run(path, 64, 48)
    assert result.pixels.shape == (3, 48, 64)
    assert result.pixels.dtype == np.float32
    assert result.pixels.min() >= -1.0 and result.pixels.max() <= 1.0
    assert result.original_size == (200, 300)


def test_center_crop_matches_a_direct_pillow_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "img.png"
    make_image(200, 100, seed=4).save(path)
    result = _run(path, 64, 64)
    # cover 64x64: 200x100 -> 128x64, crop 32 px from the left
    assert result.crop_top_left == (0, 32)
    expected = Image.open(path).convert("RGB").resize((128, 64), Image.Resampling.LANCZOS).crop((32, 0, 96, 64))
    expected_pixels = np.asarray(expected, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    np.testing.assert_array_equal(result.pixels, expected_pixels)


def test_orientation_is_applied_to_the_pixels(tmp_path: Path) -> None:
    image = make_image(120, 80, seed=2)
    plain, rotated = tmp_path / "plain.png", tmp_path / "rotated.jpg"
    image.save(plain)
    save(image, str(rotated), "JPEG", orientation=6, quality=100)
    a, b = _run(plain, 96, 64), _run(rotated, 96, 64)
    assert np.abs(a.pixels - b.pixels).mean() < 0.05  # same picture, up to JPEG loss
    assert ImageOps.exif_transpose(Image.open(rotated)).size == (120, 80)


def test_random_crop_depends_on_the_seed_only(tmp_path: Path) -> None:
    path = tmp_path / "wide.png"
    make_image(400, 100).save(path)
    first = _run(path, 64, 64, CropMode.RANDOM, "image-a").crop_top_left
    assert _run(path, 64, 64, CropMode.RANDOM, "image-a").crop_top_left == first
    offsets = {_run(path, 64, 64, CropMode.RANDOM, f"image-{i}").crop_top_left for i in range(12)}
    assert len(offsets) > 3  # different images get different crops
    assert all(top == 0 and 0 <= left <= 256 - 64 for top, left in offsets)


def test_big_jpeg_is_decoded_at_a_reduced_scale_with_the_same_geometry(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    make_image(2048, 1536).save(path, quality=90)
    result = _run(path, 128, 96)
    assert result.pixels.shape == (3, 96, 128)
    assert result.original_size == (1536, 2048) and result.crop_top_left == (0, 0)


@pytest.mark.parametrize("data", [b"", b"not an image", b"\xff\xd8\xff\xe0" + b"\x00" * 40])
def test_undecodable_data_is_a_preprocess_error(data: bytes) -> None:
    with pytest.raises(PreprocessError):
        preprocess(io.BytesIO(data), 64, 64, CropMode.CENTER, "k")


def test_truncated_pixels_are_a_preprocess_error(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    make_image(256, 256).save(buffer, "PNG")
    with pytest.raises(PreprocessError):
        preprocess(io.BytesIO(buffer.getvalue()[:-2000]), 64, 64, CropMode.CENTER, "k")


def test_a_plugin_that_raises_not_implemented_error_is_a_preprocess_error_naming_it() -> None:
    """stk-cache's decode (and --vae-on-the-fly's): the image's error row, not the end of the job."""
    with pytest.raises(PreprocessError) as info:
        preprocess(io.BytesIO(unimplemented_dds()), 64, 64, CropMode.CENTER, "k")
    assert (info.value.kind, str(info.value)) == (
        "decode_failed",
        "cannot decode: NotImplementedError: Unimplemented DXGI format 93",
    )


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (RuntimeError("plugin bug"), ("decode_failed", "cannot decode: RuntimeError: plugin bug")),
        (MemoryError(), ("out_of_memory", "out of memory decoding it (MemoryError)")),
        (KeyboardInterrupt(), None),  # not the image's: raised as it is
        (InfraError("S3 gone past the budget"), None),
    ],
)
def test_whatever_a_decoder_raises_is_a_preprocess_error_unless_an_interrupt_or_the_storage(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException, expected: tuple[str, str] | None
) -> None:
    monkeypatch.setattr(preprocess_module, "open_image", raising(raised))
    with pytest.raises(PreprocessError if expected else type(raised)) as info:
        preprocess(io.BytesIO(b"anything"), 64, 64, CropMode.CENTER, "k")
    if expected:
        assert isinstance(info.value, PreprocessError) and (info.value.kind, str(info.value)) == expected
