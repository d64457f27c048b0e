"""Image size, format and EXIF orientation from the header alone, without decoding pixels.

Pillow's lazy `Image.open` reads only the header. Two details keep it header-only: EXIF is
parsed from the bytes Pillow already holds (`getexif()` on a PNG would decode the image), and
a truncated file is caught by looking at its last bytes (an end marker or a declared length)
instead of decoding it.
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from stk.errors import InfraError

__all__ = [
    "IMAGE_EXTENSIONS",
    "SUPPORTED_FORMATS",
    "ImageError",
    "ImageHeader",
    "is_image_name",
    "read_header",
]

# Files with these extensions are treated as images; the ones Pillow cannot read or that stk
# does not train on become error rows instead of being skipped silently.
IMAGE_EXTENSIONS = frozenset(
    [
        ".jpg",
        ".jpeg",
        ".jpe",
        ".jfif",
        ".png",
        ".webp",
        ".gif",
        ".bmp",
        ".tif",
        ".tiff",
        ".heic",
        ".heif",
        ".avif",
        ".jxl",
        ".jp2",
        ".ppm",
        ".tga",
    ]
)
SUPPORTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF"})
_ORIENTATION_TAG = 0x0112
_TIFF_WIDTH, _TIFF_LENGTH = 256, 257  # ImageWidth, ImageLength
_SWAPS_AXES = frozenset({5, 6, 7, 8})
_TAIL_BYTES = 32

# stk enforces its own --max-pixels; Pillow's bomb check would otherwise raise on big headers.
Image.MAX_IMAGE_PIXELS = None
# Pillow warns about odd files (corrupt EXIF...); stk reports bad files itself. One filter for the
# process: warnings.catch_warnings() per call is not thread-safe and leaks filters across threads.
warnings.filterwarnings("ignore", module=r"PIL\.")


def is_image_name(name: str) -> bool:
    dot = name.rfind(".")
    return dot >= 0 and name[dot:].lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class ImageHeader:
    width: int  # after EXIF orientation
    height: int
    format: str
    orientation: int


class ImageError(Exception):
    """A file that cannot be used; `kind` is a short stable name for errors.jsonl."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def read_header(f: BinaryIO, size: int, max_pixels: int | None = None) -> ImageHeader:
    """Probe an open, seekable file of `size` bytes. Raises ImageError for any unusable file."""
    if size == 0:
        raise ImageError("empty", "empty file (0 bytes)")
    head = f.read(16)
    f.seek(0)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _checked(_webp_header(f, size), head, f, size, max_pixels)
    try:
        im = Image.open(f)
        fmt = str(im.format)
        width, height = _stored_size(im)
        orientation = _orientation(im)
    except UnidentifiedImageError as exc:
        raise ImageError("not_image", "not an image: content not recognised by Pillow") from exc
    except (SyntaxError, ValueError, EOFError, struct.error, OSError, IndexError, KeyError) as exc:
        raise ImageError("corrupt", f"corrupt or truncated header: {exc}") from exc
    if fmt not in SUPPORTED_FORMATS:
        raise ImageError("unsupported_format", f"unsupported format {fmt}")
    return _checked(ImageHeader(width, height, fmt, orientation), head, f, size, max_pixels)


def _checked(header: ImageHeader, head: bytes, f: BinaryIO, size: int, max_pixels: int | None) -> ImageHeader:
    """Apply the pixel limit and the truncation check; swap axes for a rotated orientation."""
    width, height, fmt, orientation = header.width, header.height, header.format, header.orientation
    if width <= 0 or height <= 0:
        raise ImageError("corrupt", f"header declares an empty image ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError(
            "too_many_pixels", f"{width}x{height} = {width * height} pixels exceeds --max-pixels {max_pixels}"
        )
    f.seek(max(size - _TAIL_BYTES, 0))
    tail = f.read(_TAIL_BYTES)
    problem = _truncation(fmt, head, tail, size)
    if problem and not _decodes(f):
        raise ImageError("truncated", f"truncated {fmt}: {problem}")
    if orientation in _SWAPS_AXES:
        width, height = height, width
    return ImageHeader(width, height, fmt, orientation)


def _webp_header(f: BinaryIO, size: int) -> ImageHeader:
    """Size and orientation from a WebP's RIFF chunks, seeking past the bitstream.

    Pillow's WebP plugin reads the whole file before it reports a size (one full download
    per image on S3); the header fields are few and fixed (RFC 9649), so they are read here."""
    width = height = 0
    orientation, pos, wants_exif = 1, 12, False
    while pos + 8 <= size:
        f.seek(pos)
        chunk = f.read(8)
        if len(chunk) < 8:
            break
        fourcc, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        if fourcc == b"VP8X":
            data = f.read(10)
            if len(data) < 10:
                break
            wants_exif = bool(data[0] & 0x08)
            width = 1 + int.from_bytes(data[4:7], "little")
            height = 1 + int.from_bytes(data[7:10], "little")
        elif fourcc == b"VP8 " and not width:
            data = f.read(10)
            if len(data) < 10 or data[3:6] != b"\x9d\x01\x2a":
                raise ImageError("corrupt", "corrupt or truncated header: bad VP8 start code")
            width = struct.unpack("<H", data[6:8])[0] & 0x3FFF
            height = struct.unpack("<H", data[8:10])[0] & 0x3FFF
        elif fourcc == b"VP8L" and not width:
            data = f.read(5)
            if len(data) < 5 or data[0] != 0x2F:
                raise ImageError("corrupt", "corrupt or truncated header: bad VP8L signature")
            bits = int.from_bytes(data[1:5], "little")
            width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        elif fourcc == b"EXIF":
            exif = Image.Exif()
            try:
                exif.load(f.read(length))
            except (SyntaxError, ValueError, struct.error, OSError, KeyError, IndexError):
                break  # unreadable EXIF: no orientation, as with other formats
            orientation = _valid_orientation(exif.get(_ORIENTATION_TAG, 1))
            break
        if width and not wants_exif:
            break
        pos += 8 + length + (length & 1)
    if not width:
        raise ImageError("corrupt", "corrupt or truncated header: no WebP image chunk")
    return ImageHeader(width, height, "WEBP", orientation)


def _valid_orientation(value: object) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 1
    return number if 1 <= number <= 8 else 1


def _stored_size(im: Image.Image) -> tuple[int, int]:
    """Width and height as stored, before EXIF orientation. Recent Pillow (13.0 here) reports a TIFF's
    size already turned by its orientation tag; the stored size comes from its IFD instead."""
    if im.format == "TIFF":
        tags = im.tag_v2  # type: ignore[attr-defined]
        return int(tags.get(_TIFF_WIDTH, im.width)), int(tags.get(_TIFF_LENGTH, im.height))
    return im.size


def _orientation(im: Image.Image) -> int:
    if im.format == "TIFF":
        value = im.tag_v2.get(_ORIENTATION_TAG, 1)  # type: ignore[attr-defined]
    else:
        raw = im.info.get("exif")
        if not raw:
            return 1
        exif = Image.Exif()
        exif.load(raw)
        value = exif.get(_ORIENTATION_TAG, 1)
    return _valid_orientation(value)


def _decodes(f: BinaryIO) -> bool:
    """Whether the whole image decodes: the slow check, run only when the tail looks wrong
    (data after the end marker, as in phone "motion photos", is whole; a cut file is not)."""
    f.seek(0)
    try:
        with Image.open(f) as im:
            im.load()
    except InfraError:  # the storage failed while Pillow read, not the image
        raise
    except Exception:  # any decoder failure means the pixels are not all there
        return False
    return True


def _truncation(fmt: str, head: bytes, tail: bytes, size: int) -> str | None:
    """Why the file may be cut short, from its first and last bytes; None if it looks whole.

    TIFF has no end marker and is not checked."""
    trimmed = tail.rstrip(b"\x00")  # some writers pad after the end marker
    if fmt in ("JPEG", "MPO") and not trimmed.endswith(b"\xff\xd9"):
        return "no end-of-image marker (FF D9)"
    if fmt == "PNG" and not tail.endswith(b"IEND\xaeB`\x82"):
        return "does not end with an IEND chunk"
    if fmt == "GIF" and not trimmed.endswith(b";"):
        return "no trailer byte (3B)"
    if fmt == "WEBP" and len(head) >= 8:
        declared = struct.unpack("<I", head[4:8])[0] + 8
        if declared > size:
            return f"RIFF header declares {declared} bytes, file has {size}"
    if fmt == "BMP" and len(head) >= 6:
        declared = struct.unpack("<I", head[2:6])[0]
        if declared > size:
            return f"header declares {declared} bytes, file has {size}"
    return None


def read_header_bytes(data: bytes, max_pixels: int | None = None) -> ImageHeader:
    """read_header for bytes already in memory (tests, tables)."""
    return read_header(io.BytesIO(data), len(data), max_pixels)
