"""Unit tests for stk.images.info: header-only size, format and EXIF orientation, and which names are images."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.image_files import probe_file, read_header_bytes, write

from stk.datagen import FORMAT_SAMPLES, FORMATS, make_image, save
from stk.images.info import ImageHeader, is_image_name, read_header

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


def save_with_orientation(path: Path, fmt: str, width: int, height: int, orientation: int) -> None:
    """Pixels stored as width x height, tagged with `orientation` (no rotation of the pixels)."""
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    kwargs: dict[str, Any] = {"exif": exif}
    make_image(width, height).save(path, fmt, **kwargs)


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
