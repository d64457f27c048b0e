"""Every format a trainer can decode (stk.images.formats): AVIF, HEIC, JPEG XL, JPEG 2000, TGA and PNM read header-only
with their orientation transforms, damaged EXIF kept as a warning, --formats. The corpus is made by the tests
(stk.datagen); the CLIs on it: tests/integration/test_imageformats.py."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from stk.datagen import FORMAT_SAMPLES, make_image
from stk.images.formats import accepted_formats, open_image
from stk.images.info import ImageError, read_header
from stk.images.preprocess import CropMode, PreprocessError, preprocess


def header_of(path: Path, **options: object) -> object:
    data = path.read_bytes()
    return read_header(io.BytesIO(data), len(data), name=path.name, **options)  # type: ignore[arg-type]


def decoded_size(path: Path) -> tuple[int, int]:
    """What a trainer sees: the whole decode, with the orientation applied."""
    with open(path, "rb") as f, open_image(f) as im:
        return ImageOps.exif_transpose(im).size


def test_the_corpus_holds_every_format_and_transform(format_corpus):
    _, samples = format_corpus
    assert {s.format for s in samples if s.verdict != "error"} >= set(FORMAT_SAMPLES) | {"JPEG"}
    turned = {(s.format, s.path.rsplit("/o", 1)[-1].split(".")[0]) for s in samples if "/o" in s.path}
    assert {o for f, o in turned if f == "AVIF"} == {o for f, o in turned if f == "HEIF"} == set("12345678")


def test_every_sample_reads_as_its_decode_shows_it(format_corpus):
    root, samples = format_corpus
    for sample in samples:
        path = root / sample.path
        if sample.verdict == "error":
            with pytest.raises(ImageError) as raised:
                header_of(path)
            assert raised.value.kind == sample.kind and sample.format in raised.value.reason, sample
            continue
        header = header_of(path)
        assert (header.width, header.height) == (sample.width, sample.height) == decoded_size(path), sample
        assert header.format == sample.format, sample
        assert (header.warning.kind if header.warning else None) == sample.kind, sample


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["AVIF", "HEIF"])
def test_irot_and_imir_give_the_exif_orientation_they_stand_for(tmp_path, fmt, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"a{FORMAT_SAMPLES[fmt][0]}"
    make_image(50, 30).save(path, fmt, exif=exif.tobytes())  # the writers turn EXIF into irot/imir boxes
    data = path.read_bytes()
    assert (b"irot" in data or b"imir" in data) == (orientation != 1)
    header = header_of(path)
    assert header.orientation == orientation
    assert (header.width, header.height) == decoded_size(path) == ((30, 50) if orientation >= 5 else (50, 30))


def test_an_avif_that_names_mif1_first_is_an_avif(format_corpus, tmp_path):
    data = bytearray((format_corpus[0] / "avif/o6.avif").read_bytes())
    assert data[8:12] == b"avif" and b"mif1" in data[16:32]
    data[8:12] = b"mif1"  # the major brand; avif stays among the compatible ones
    (tmp_path / "a.avif").write_bytes(bytes(data))
    header = header_of(tmp_path / "a.avif")
    assert (header.format, header.width, header.height) == ("AVIF", 48, 72)


@pytest.mark.parametrize("size", [(64, 40), (100, 75), (33, 17), (1000, 3), (256, 256), (300, 200)])
def test_jpeg_xl_sizes_every_header_encoding(tmp_path, size):
    """Small (multiples of 8) and large sizes, and widths given as a ratio of the height."""
    path = tmp_path / "a.jxl"
    make_image(*size).save(path, "JXL")
    assert path.read_bytes()[:2] == b"\xff\x0a"  # a bare codestream
    header = header_of(path)
    assert (header.width, header.height) == size == decoded_size(path)


@pytest.mark.parametrize("fraction", [1 / 3, 2 / 3, 0.95])
@pytest.mark.parametrize(
    "name",
    [
        "avif/o6.avif",
        "heif/o6.heic",
        "jxl/o6.jxl",
        "jpeg2000/o1.jp2",
        "jpeg2000/codestream.j2k",
        "tga/o1.tga",
        "ppm/o1.ppm",
        "ppm/grey.pgm",
    ],
)
def test_a_file_cut_short_is_an_error(format_corpus, tmp_path, name, fraction):
    data = (format_corpus[0] / name).read_bytes()
    cut = tmp_path / Path(name).name
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ImageError) as raised:
        header_of(cut)
    assert raised.value.kind in ("truncated", "corrupt"), raised.value.reason


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("cut", "entries do not fit"),
        ("garbage", "no TIFF header"),
        ("value", "runs past the end"),
    ],
)
def test_damaged_exif_keeps_the_image_with_orientation_1_and_a_warning(tmp_path, damage, expected):
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010E] = "a description longer than four bytes"  # a value stored after the directory
    raw = exif.tobytes()
    raw = {"cut": raw[:16], "garbage": b"Exif\x00\x00" + bytes(range(7, 60)), "value": raw[:-8]}[damage]
    path = tmp_path / "a.jpg"
    make_image(60, 40).save(path, "JPEG", exif=raw)
    header = header_of(path)
    assert (header.width, header.height, header.orientation) == (60, 40, 1)
    assert header.warning is not None and header.warning.kind == "exif_unreadable"
    assert expected in header.warning.reason
    with open(path, "rb") as f:
        assert preprocess(f, 64, 64, CropMode.CENTER, "k").original_size == (40, 60)  # decoded as scanned


def test_formats_stk_does_not_train_on_are_named(tmp_path):
    for fmt, name in (("ICO", "a.ico"), ("PCX", "a.pcx"), ("DDS", "a.dds")):
        make_image(32, 32).save(tmp_path / name, fmt)
        with pytest.raises(ImageError, match=f"unsupported format {fmt}") as raised:
            header_of(tmp_path / name)
        assert raised.value.kind == "unsupported_format"
    (tmp_path / "a.pam").write_bytes(b"P7\nWIDTH 2\nHEIGHT 2\nDEPTH 3\nMAXVAL 255\nTUPLTYPE RGB\nENDHDR\n" + bytes(12))
    with pytest.raises(ImageError, match="unsupported format PAM"):
        header_of(tmp_path / "a.pam")


def test_formats_narrows_the_accepted_set(format_corpus):
    root, _ = format_corpus
    only = accepted_formats("jpeg, png")
    with pytest.raises(ImageError, match=r"unsupported format AVIF \(not in --formats\)"):
        header_of(root / "avif/o1.avif", accepted=only)
    assert header_of(root / "damaged/exif-cut.jpg", accepted=only).format == "JPEG"
    assert accepted_formats("heic") == {"HEIF"} and accepted_formats("jpeg") == {"JPEG", "MPO"}
    for bad in ("jpeg,psd", "", ","):
        with pytest.raises(ValueError, match="choose from jpeg,png"):
            accepted_formats(bad)


def test_libtiff_says_nothing_on_stderr(tmp_path, capfd):
    """A TIFF compressed with a codec the bundled libtiff lacks: one error for its row, no C-library text."""
    buffer = io.BytesIO()
    make_image(16, 16).save(buffer, "TIFF", compression="tiff_lzw")
    data = bytearray(buffer.getvalue())
    ifd = struct.unpack("<I", data[4:8])[0]
    for i in range(struct.unpack("<H", data[ifd : ifd + 2])[0]):
        entry = ifd + 2 + 12 * i
        if struct.unpack("<H", data[entry : entry + 2])[0] == 259:  # Compression
            data[entry + 8 : entry + 10] = struct.pack("<H", 50001)  # WEBP
    capfd.readouterr()
    with pytest.raises(PreprocessError, match="cannot decode"):
        preprocess(io.BytesIO(bytes(data)), 16, 16, CropMode.CENTER, "k")
    assert capfd.readouterr().err == ""
