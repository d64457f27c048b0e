"""Unit tests for stk.images.info's error kinds: empty, cut, mislabelled and oversized files, formats stk does not train
on, and whatever a decoder raises."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from support.bad_inputs import raising, unimplemented_dds
from support.image_files import probe_file, read_header_bytes, write

from stk.datagen import make_image
from stk.errors import InfraError
from stk.images import info as imageinfo
from stk.images.info import ImageError


def error_kind(data: bytes, max_pixels: int | None = None) -> str:
    with pytest.raises(ImageError) as info:
        read_header_bytes(data, max_pixels)
    assert info.value.reason and str(info.value) == info.value.reason
    return info.value.kind


def test_empty_file() -> None:
    assert error_kind(b"") == "empty"


def test_empty_file_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    with pytest.raises(ImageError) as info:
        probe_file(path)
    assert info.value.kind == "empty"


def test_text_in_a_jpg_is_not_an_image(tmp_path: Path) -> None:
    path = tmp_path / "notes.jpg"
    path.write_text("these are my holiday notes, not a photo\n" * 20)
    with pytest.raises(ImageError) as info:
        probe_file(path)
    assert info.value.kind == "not_image"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "WEBP"])
def test_file_cut_in_half(tmp_path: Path, fmt: str) -> None:
    data = write(tmp_path, fmt, 200, 150).read_bytes()
    read_header_bytes(data)  # whole: fine
    assert error_kind(data[: len(data) // 2]) == "truncated"


def test_png_cut_inside_its_pixel_data(tmp_path: Path) -> None:
    data = write(tmp_path, "PNG", 200, 150).read_bytes()
    assert error_kind(data[: len(data) * 2 // 3]) == "truncated"


def test_png_missing_only_its_end_chunk_is_whole(tmp_path: Path) -> None:
    # the tail looks wrong, so the file is decoded: every pixel is there, the image is usable
    data = write(tmp_path, "PNG", 200, 150).read_bytes()
    assert read_header_bytes(data[:-12]).width == 200


def test_png_cut_inside_its_header() -> None:
    buffer = io.BytesIO()
    make_image(64, 64).save(buffer, "PNG")
    # signature (8) + part of IHDR: Pillow cannot read the header
    assert error_kind(buffer.getvalue()[:20]) in {"corrupt", "truncated", "not_image"}


def test_jpeg_first_10_bytes_only(tmp_path: Path) -> None:
    data = write(tmp_path, "JPEG", 200, 150).read_bytes()
    assert error_kind(data[:10]) in {"corrupt", "truncated"}


def test_webp_cut_inside_its_header(tmp_path: Path) -> None:
    data = write(tmp_path, "WEBP", 200, 150).read_bytes()
    assert error_kind(data[:16]) == "corrupt"


def test_webp_with_a_bad_vp8_start_code(tmp_path: Path) -> None:
    data = bytearray(write(tmp_path, "WEBP", 200, 150).read_bytes())
    assert data[12:16] == b"VP8 "
    data[23:26] = b"\x00\x00\x00"  # the start code 9D 01 2A after the frame tag
    assert error_kind(bytes(data)) == "corrupt"


def test_bmp_shorter_than_declared(tmp_path: Path) -> None:
    data = write(tmp_path, "BMP", 20, 20).read_bytes()
    assert error_kind(data[:-1]) == "truncated"


def test_gif_cut_inside_its_pixel_data(tmp_path: Path) -> None:
    data = write(tmp_path, "GIF", 200, 150).read_bytes()
    assert data.endswith(b";")
    assert error_kind(data[: len(data) // 2]) == "truncated"


def test_jpeg_with_data_after_its_end_marker_is_whole(tmp_path: Path) -> None:
    # phone "motion photos" append a video after the JPEG's end marker
    data = write(tmp_path, "JPEG", 120, 80).read_bytes() + b"ftypmp42" + bytes(range(256)) * 4
    assert read_header_bytes(data).width == 120


@pytest.mark.parametrize("fmt", ["ICO", "PCX", "DDS"])
def test_formats_pillow_reads_but_stk_does_not_train_on(fmt: str) -> None:
    buffer = io.BytesIO()
    make_image(32, 32).save(buffer, fmt)
    assert error_kind(buffer.getvalue()) == "unsupported_format"


def test_a_plugin_that_raises_not_implemented_error_is_a_decoder_error_naming_it() -> None:
    with pytest.raises(ImageError) as info:
        read_header_bytes(unimplemented_dds())
    assert info.value.kind == "decoder_error"
    assert info.value.reason == "the image decoder failed: NotImplementedError: Unimplemented DXGI format 93"


def _png() -> bytes:
    buffer = io.BytesIO()
    make_image(8, 8).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("raised", "kind", "reason"),
    [
        (RuntimeError("plugin bug"), "decoder_error", "the image decoder failed: RuntimeError: plugin bug"),
        (AssertionError(), "decoder_error", "the image decoder failed: AssertionError"),
        (TypeError("bad tag"), "decoder_error", "the image decoder failed: TypeError: bad tag"),
        (ValueError("bad size"), "corrupt", "corrupt or truncated header: ValueError: bad size"),
        (MemoryError(), "out_of_memory", "out of memory reading its header (MemoryError)"),
    ],
)
def test_whatever_a_decoder_raises_is_the_files_error(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, kind: str, reason: str
) -> None:
    monkeypatch.setattr(imageinfo, "open_image", raising(raised))
    with pytest.raises(ImageError) as info:
        read_header_bytes(_png())
    assert (info.value.kind, info.value.reason) == (kind, reason)


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), SystemExit(2), InfraError("S3 gone past the budget")])
def test_an_interrupt_or_a_storage_failure_is_not_the_files(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException
) -> None:
    monkeypatch.setattr(imageinfo, "open_image", raising(raised))
    with pytest.raises(type(raised)):
        read_header_bytes(_png())


def test_unsupported_format_reason_names_the_format() -> None:
    buffer = io.BytesIO()
    make_image(32, 32).save(buffer, "ICO")
    with pytest.raises(ImageError, match="ICO"):
        read_header_bytes(buffer.getvalue())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "TIFF"])
def test_max_pixels(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path, fmt, 120, 80)
    assert probe_file(path, max_pixels=120 * 80).width == 120  # at the limit: fine
    with pytest.raises(ImageError) as info:
        probe_file(path, max_pixels=120 * 80 - 1)
    assert info.value.kind == "too_many_pixels"
    assert "9600" in info.value.reason


def test_max_pixels_is_checked_before_truncation(tmp_path: Path) -> None:
    data = write(tmp_path, "JPEG", 120, 80).read_bytes()
    assert error_kind(data[: len(data) // 2], max_pixels=100) == "too_many_pixels"
