"""Image size, format and orientation from the header alone, without decoding pixels.

Pillow's lazy `Image.open` reads only the header of most formats; WebP, AVIF/HEIC and JPEG XL are
read by stk.images.headers, whose Pillow plugins would read the whole file. Two details keep the
rest header-only: EXIF is parsed from the bytes Pillow already holds (`getexif()` on a PNG would
decode the image), and a truncated file is caught by looking at its last bytes (an end marker or
a declared length) instead of decoding it.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from PIL import Image, ImageFile, ImageMode, UnidentifiedImageError

from stk.errors import StkError, described
from stk.images.formats import ACCEPTED, EXTENSION_FORMATS, IMAGE_EXTENSIONS, open_image
from stk.images.headers import (
    JXL_CONTAINER,
    SWAPS_AXES,
    ExifUnreadable,
    ImageError,
    ImageHeader,
    heif_header,
    image_orientation,
    is_jxl,
    isobmff_truncation,
    jxl_header,
    webp_header,
)

__all__ = ["ImageError", "ImageHeader", "is_image_name", "read_header"]

_TIFF_WIDTH, _TIFF_LENGTH = 256, 257  # ImageWidth, ImageLength
_TAIL_BYTES = 32
# what Pillow and stk's own readers raise for damaged bytes
_CORRUPT = (SyntaxError, ValueError, EOFError, struct.error, OSError, IndexError, KeyError)
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"})


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def read_header(
    f: BinaryIO, size: int, max_pixels: int | None = None, accepted: frozenset[str] = ACCEPTED, name: str = ""
) -> ImageHeader:
    """Probe an open, seekable file of `size` bytes (`name` for formats told by extension only).
    Raises ImageError for any unusable file; damaged metadata is a `warning` on the header."""
    if size == 0:
        raise ImageError("empty", "empty file (0 bytes)")
    try:
        head = f.read(16)
        f.seek(0)
        header = _own_header(f, head, size) or _pillow_header(f, name)
        if header.format not in accepted:
            allowed = "" if accepted == ACCEPTED else " (not in --formats)"
            raise ImageError("unsupported_format", f"unsupported format {header.format}{allowed}")
        return _checked(header, head, f, size, max_pixels)
    except (ImageError, StkError):  # StkError: the storage failed while reading, not the image
        raise
    except _CORRUPT as exc:
        raise ImageError("corrupt", f"corrupt or truncated header: {described(exc)}") from exc
    except MemoryError as exc:  # the file asks for more than this process can allocate
        raise ImageError("out_of_memory", f"out of memory reading its header ({described(exc)})") from exc
    except Exception as exc:  # a decoder plugin may raise anything: still this file's fault alone
        raise ImageError("decoder_error", f"the image decoder failed: {described(exc)}") from exc


def _own_header(f: BinaryIO, head: bytes, size: int) -> ImageHeader | None:
    """The formats stk.images.headers reads; None for the rest."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return webp_header(f, size)
    if head[4:8] == b"ftyp":
        fmt = _isobmff_format(f, head)
        return heif_header(f, size, fmt) if fmt else None
    if is_jxl(head):
        return jxl_header(f, size)
    return None


def _isobmff_format(f: BinaryIO, head: bytes) -> str | None:
    """AVIF or HEIF by the `ftyp` brands (an AVIF may name `mif1` first and `avif` among the
    compatible ones); None for other ISOBMFF files."""
    length = int.from_bytes(head[:4], "big")
    f.seek(8)
    brands = f.read(min(max(length - 8, 0), 256))
    f.seek(0)
    names = {brands[:4]} | {brands[i : i + 4] for i in range(8, len(brands) - 3, 4)}  # 4..8: the minor version
    if names & _AVIF_BRANDS:
        return "AVIF"
    return "HEIF" if names & _HEIF_BRANDS else None


def _pillow_header(f: BinaryIO, name: str) -> ImageHeader:
    try:
        im = open_image(f)
    except UnidentifiedImageError as exc:
        fmt = EXTENSION_FORMATS.get(os.path.splitext(name)[1].lower())
        if fmt:
            raise ImageError("unsupported_format", f"unsupported format {fmt}") from exc
        raise ImageError("not_image", "not an image: content not recognised by Pillow") from exc
    width, height = _stored_size(im)
    orientation, warning = 1, None
    try:
        orientation = image_orientation(im)
    except ExifUnreadable as exc:
        warning = exc.warning()
    return ImageHeader(width, height, str(im.format), orientation, warning, _raw_bytes(im))


def _raw_bytes(im: ImageFile.ImageFile) -> int:
    """Where the pixels of an uncompressed image (PNM, plain TGA) end, by its header; 0 for others.
    An estimate from above at worst (a 16-bit TGA counted as 24): that only costs a full decode."""
    tile = im.tile[0] if len(im.tile) == 1 else None
    if tile is None or tile.codec_name != "raw" or not tile.args or not tile.extents:
        return 0
    rawmode = tile.args if isinstance(tile.args, str) else tile.args[0]
    bits = 1 if im.mode == "1" else 8 * len(ImageMode.getmode(im.mode).bands) * (2 if "16" in rawmode else 1)
    width, height = tile.extents[2] - tile.extents[0], tile.extents[3] - tile.extents[1]
    return tile.offset + (width * bits + 7) // 8 * height


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
    problem = _truncation(header, head, tail, size, f)
    if problem and not _decodes(f):
        raise ImageError("truncated", f"truncated {fmt}: {problem}")
    if orientation in SWAPS_AXES:
        width, height = height, width
    return ImageHeader(width, height, fmt, orientation, header.warning)


def _stored_size(im: Image.Image) -> tuple[int, int]:
    """Width and height as stored, before EXIF orientation. Recent Pillow (13.0 here) reports a TIFF's
    size already turned by its orientation tag; the stored size comes from its IFD instead."""
    if im.format == "TIFF":
        tags = im.tag_v2  # type: ignore[attr-defined]
        return int(tags.get(_TIFF_WIDTH, im.width)), int(tags.get(_TIFF_LENGTH, im.height))
    return im.size


def _decodes(f: BinaryIO) -> bool:
    """Whether the whole image decodes: the slow check, run only when the tail looks wrong
    (data after the end marker, as in phone "motion photos", is whole; a cut file is not)."""
    f.seek(0)
    try:
        with open_image(f) as im:
            im.load()
    except (StkError, MemoryError):  # the storage or the memory failed, not the image
        raise
    except Exception:  # any decoder failure means the pixels are not all there
        return False
    return True


def _truncation(header: ImageHeader, head: bytes, tail: bytes, size: int, f: BinaryIO) -> str | None:
    """Why the file may be cut short, from its first and last bytes; None if it looks whole.

    TIFF, a bare JPEG XL codestream and compressed TGA have no end marker and are not checked."""
    fmt = header.format
    trimmed = tail.rstrip(b"\x00")  # some writers pad after the end marker
    if fmt in ("JPEG", "MPO") and not trimmed.endswith(b"\xff\xd9"):
        return "no end-of-image marker (FF D9)"
    if fmt == "JPEG2000" and not trimmed.endswith(b"\xff\xd9"):
        return "no end-of-codestream marker (FF D9)"
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
    if fmt in ("AVIF", "HEIF") or (fmt == "JXL" and head.startswith(JXL_CONTAINER)):
        return isobmff_truncation(f, size, fmt)
    if header.min_bytes > size:
        return f"header declares at least {header.min_bytes} bytes, file has {size}"
    return None
