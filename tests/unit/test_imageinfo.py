"""Unit tests for stk.imageinfo: header-only size, format and EXIF orientation, and error kinds."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.bad_inputs import raising, unimplemented_dds

from stk import imageinfo
from stk.datagen import FORMAT_SAMPLES, FORMATS, make_image, save
from stk.errors import InfraError
from stk.imageinfo import ImageError, ImageHeader, is_image_name, read_header

ORIENTATION_TAG = 0x0112


class CountingReader(io.RawIOBase):
    """A seekable reader over a real file that records every (offset, length) it reads."""

    def __init__(self, raw: io.BufferedReader) -> None:
        self._raw = raw
        self.reads: list[tuple[int, int]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer: Any) -> int:
        start = self._raw.tell()
        data = self._raw.read(len(buffer))
        buffer[: len(data)] = data
        self.reads.append((start, len(data)))
        return len(data)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.reads)


def read_header_bytes(data: bytes, max_pixels: int | None = None) -> ImageHeader:
    return read_header(io.BytesIO(data), len(data), max_pixels)


def probe_file(path: Path, max_pixels: int | None = None) -> ImageHeader:
    with open(path, "rb") as f:
        return read_header(f, os.path.getsize(path), max_pixels)


def error_kind(data: bytes, max_pixels: int | None = None) -> str:
    with pytest.raises(ImageError) as info:
        read_header_bytes(data, max_pixels)
    assert info.value.reason and str(info.value) == info.value.reason
    return info.value.kind


def write(tmp_path: Path, fmt: str, width: int, height: int, name: str = "img", **kwargs: Any) -> Path:
    path = tmp_path / f"{name}{FORMATS[fmt]}"
    save(make_image(width, height, seed=width + height), str(path), fmt, **kwargs)
    return path


def save_with_orientation(path: Path, fmt: str, width: int, height: int, orientation: int) -> None:
    """Pixels stored as width x height, tagged with `orientation` (no rotation of the pixels)."""
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    kwargs: dict[str, Any] = {"exif": exif}
    make_image(width, height).save(path, fmt, **kwargs)


# --- formats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(("width", "height"), [(120, 80), (61, 97), (1, 1)])
def test_read_header_every_supported_format(tmp_path: Path, fmt: str, width: int, height: int) -> None:
    path = write(tmp_path, fmt, width, height)
    header = probe_file(path)
    assert header == ImageHeader(width, height, fmt, 1)


def test_read_header_bytes_matches_read_header(tmp_path: Path) -> None:
    path = write(tmp_path, "PNG", 33, 44)
    assert read_header_bytes(path.read_bytes()) == probe_file(path) == ImageHeader(33, 44, "PNG", 1)


def test_jpeg_padded_with_zeros_after_the_end_marker_is_whole(tmp_path: Path) -> None:
    data = write(tmp_path, "JPEG", 40, 30).read_bytes() + b"\x00" * 16
    assert read_header_bytes(data) == ImageHeader(40, 30, "JPEG", 1)


@pytest.mark.parametrize(
    ("kwargs", "mode", "chunk"),
    [
        ({"lossless": False}, "RGB", b"VP8 "),
        ({"lossless": True}, "RGB", b"VP8L"),
        ({"lossless": False}, "RGBA", b"VP8X"),
    ],
    ids=["lossy", "lossless", "extended"],
)
def test_webp_variants(tmp_path: Path, kwargs: dict[str, Any], mode: str, chunk: bytes) -> None:
    path = tmp_path / "v.webp"
    image = make_image(37, 23)
    if mode == "RGBA":  # a real alpha channel, or libwebp drops it and writes a simple file
        image.putalpha(Image.linear_gradient("L").resize(image.size))
    image.save(path, "WEBP", **kwargs)
    data = path.read_bytes()
    assert data[12:16] == chunk  # the variant under test really was written
    assert probe_file(path) == ImageHeader(37, 23, "WEBP", 1)


# --- EXIF orientation ------------------------------------------------------------------------------

ORIENTED_FORMATS = ["JPEG", "WEBP", "PNG", "TIFF"]


@pytest.mark.parametrize("fmt", ORIENTED_FORMATS)
@pytest.mark.parametrize("orientation", [6, 8, 5, 7])
def test_orientation_that_swaps_axes_gives_portrait(tmp_path: Path, fmt: str, orientation: int) -> None:
    path = tmp_path / f"landscape{FORMATS[fmt]}"
    save_with_orientation(path, fmt, 120, 80, orientation)
    header = probe_file(path)
    assert (header.width, header.height) == (80, 120)
    assert header.orientation == orientation
    assert header.format == fmt


@pytest.mark.parametrize("fmt", ORIENTED_FORMATS)
@pytest.mark.parametrize("orientation", [1, 2, 3, 4])
def test_orientation_that_keeps_axes_keeps_the_stored_size(tmp_path: Path, fmt: str, orientation: int) -> None:
    path = tmp_path / f"landscape{FORMATS[fmt]}"
    save_with_orientation(path, fmt, 120, 80, orientation)
    header = probe_file(path)
    assert (header.width, header.height, header.orientation) == (120, 80, orientation)


@pytest.mark.parametrize("fmt", ORIENTED_FORMATS)
def test_datagen_rotated_images_read_back_as_displayed(tmp_path: Path, fmt: str) -> None:
    # datagen stores the pixels turned and tags them, as a camera does; the header must undo it
    path = write(tmp_path, fmt, 90, 50, orientation=6)
    with Image.open(path) as im:
        stored_tag = im.getexif().get(ORIENTATION_TAG)
    assert stored_tag == 6
    assert probe_file(path) == ImageHeader(90, 50, fmt, 6)


@pytest.mark.parametrize("value", [0, 9, 300])
def test_out_of_range_orientation_counts_as_1(tmp_path: Path, value: int) -> None:
    path = tmp_path / "odd.jpg"
    save_with_orientation(path, "JPEG", 120, 80, value)
    assert probe_file(path) == ImageHeader(120, 80, "JPEG", 1)


# --- error kinds -------------------------------------------------------------------------------------


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


# --- header only ----------------------------------------------------------------------------------

HEADER_LIMIT = 4096  # every read must be in the first few KiB or in the last 32 bytes
TAIL = 32


@pytest.fixture(scope="module")
def big_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("big")
    image = make_image(2000, 2000, seed=3)
    noise = Image.merge("RGB", [Image.effect_noise((300, 300), 64) for _ in range(3)])
    image.paste(noise, (850, 850))  # so that PNG does not compress the whole image to a few KiB
    files = {}
    for fmt in FORMATS:
        path = root / f"big{FORMATS[fmt]}"
        save(image, str(path), fmt)
        files[fmt] = path
    for fmt, (ext, _) in FORMAT_SAMPLES.items():
        files[fmt] = root / f"big{ext}"
        image.save(files[fmt], fmt)
    return files


@pytest.mark.parametrize("fmt", [*FORMATS, *FORMAT_SAMPLES])
def test_read_header_reads_only_the_header_and_the_tail(big_files: dict[str, Path], fmt: str) -> None:
    path = big_files[fmt]
    size = os.path.getsize(path)
    with open(path, "rb") as raw:
        reader = CountingReader(raw)
        header = read_header(reader, size)  # type: ignore[arg-type]
    assert header == ImageHeader(2000, 2000, fmt, 1)
    assert size > 10 * HEADER_LIMIT, size  # the file is big enough for the test to mean something
    assert reader.total < HEADER_LIMIT, reader.reads
    for start, length in reader.reads:
        end = start + length
        assert end <= HEADER_LIMIT or start >= size - TAIL, (start, length, size)
    assert (size - TAIL, TAIL) in reader.reads  # the truncation check looked at the tail


def test_webp_with_exif_reads_little(tmp_path: Path) -> None:
    path = tmp_path / "big.webp"
    save_with_orientation(path, "WEBP", 2000, 1000, 6)
    size = os.path.getsize(path)
    with open(path, "rb") as raw:
        reader = CountingReader(raw)
        header = read_header(reader, size)  # type: ignore[arg-type]
    assert header == ImageHeader(1000, 2000, "WEBP", 6)
    assert reader.total < HEADER_LIMIT < size, (reader.reads, size)


# --- is_image_name --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a.jpg",
        "a/b/c.JPEG",
        "x.Png",
        "photo.webp",
        "anim.gif",
        "scan.tif",
        "scan.TIFF",
        "raw.bmp",
        "p.heic",
        "q.avif",
        "r.ppm",
        "s.jxl",
        "t.jp2",
        "u.TGA",
        "v.pgm",
        "w.hif",
        "x.svg",
    ],
)
def test_is_image_name_true(name: str) -> None:
    assert is_image_name(name)


@pytest.mark.parametrize(
    "name", ["a.txt", "a.caption", "README", "dir.jpg/file", "archive.jpg.gz", "a.jpgx", "", "jpg"]
)
def test_is_image_name_false(name: str) -> None:
    assert not is_image_name(name)
