"""Size and orientation of WebP, AVIF/HEIC and JPEG XL files from their first bytes.

The Pillow plugins for these formats read the whole file before they report a size (AVIF,
HEIC) or even decode it (JPEG XL): one full download per image on S3. Their header fields are
few and fixed by the specifications (RFC 9649; ISO/IEC 23008-12 and 14496-12; ISO/IEC
18181-1/-2), so they are read here with seeks and reads of a few bytes. Everything else goes
through Pillow's lazy `Image.open` (stk.images.info).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image

from stk.errors import RankSafeError

__all__ = [
    "JXL_CONTAINER",
    "ORIENTATION_TAG",
    "SWAPS_AXES",
    "ExifUnreadable",
    "ImageError",
    "ImageHeader",
    "MetadataWarning",
    "heif_header",
    "image_orientation",
    "is_jxl",
    "isobmff_truncation",
    "jxl_header",
    "orientation_from_exif",
    "webp_header",
]

ORIENTATION_TAG = 0x0112
SWAPS_AXES = frozenset({5, 6, 7, 8})  # orientations that turn the image a quarter
_EXIF_ERRORS = (SyntaxError, ValueError, struct.error, OSError, KeyError, IndexError, TypeError)


@dataclass(frozen=True)
class MetadataWarning:
    """Damaged metadata that does not stop a decode: a row in errors.jsonl with severity warning."""

    kind: str
    reason: str


@dataclass(frozen=True)
class ImageHeader:
    width: int  # as stored; read_header() turns it by `orientation` into the size a decode shows
    height: int
    format: str
    orientation: int  # EXIF numbering, 1-8
    warning: MetadataWarning | None = None  # metadata that could not be read; the image is usable
    min_bytes: int = 0  # the least a whole file holds, where the header tells (uncompressed pixels)


class ImageError(RankSafeError):
    """A file that cannot be used; `kind` is a short stable name for errors.jsonl."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class ExifUnreadable(Exception):
    """An EXIF block that cannot be parsed: the image stays, with orientation 1 and a warning."""

    def warning(self) -> MetadataWarning:
        return MetadataWarning("exif_unreadable", str(self))


def orientation_from_exif(raw: bytes) -> int:
    """The orientation tag of a raw EXIF block (1 when absent or out of range); raises
    ExifUnreadable for a block that cannot be parsed or whose first directory is cut short
    (Pillow skips what it cannot read with a warning only)."""
    tiff = raw[6:] if raw.startswith(b"Exif\x00\x00") else raw
    problem = _ifd0_problem(tiff)
    exif = Image.Exif()
    try:
        exif.load(tiff)
        value = exif.get(ORIENTATION_TAG, 1)
    except _EXIF_ERRORS as exc:
        problem = problem or f"{exc or type(exc).__name__}"
    if problem:
        raise ExifUnreadable(f"unreadable EXIF block ({problem}): orientation 1 assumed")
    try:
        number = int(value)
    except (TypeError, ValueError):
        return 1
    return number if 1 <= number <= 8 else 1


_TIFF_HEADERS = (b"II*\x00", b"MM\x00*")  # little- and big-endian
_TIFF_TYPE_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}


def _ifd0_problem(tiff: bytes) -> str | None:
    """Why the first directory of a TIFF-structured EXIF block does not fit in it; None if it does."""
    if tiff[:4] not in _TIFF_HEADERS:
        return "no TIFF header"
    order = "<" if tiff[:2] == b"II" else ">"
    offset = struct.unpack(order + "I", tiff[4:8])[0] if len(tiff) >= 8 else len(tiff)
    if offset + 2 > len(tiff):
        return f"the first directory starts at byte {offset} of {len(tiff)}"
    count = struct.unpack(order + "H", tiff[offset : offset + 2])[0]
    if offset + 2 + 12 * count > len(tiff):
        return f"{count} entries do not fit in {len(tiff)} bytes"
    for start in range(offset + 2, offset + 2 + 12 * count, 12):
        _, kind, number, value = struct.unpack(order + "HHI4s", tiff[start : start + 12])
        size = number * _TIFF_TYPE_BYTES.get(kind, 1)
        if size > 4 and struct.unpack(order + "I", value)[0] + size > len(tiff):
            return f"a value runs past the end of its {len(tiff)} bytes"
    return None


def image_orientation(image: Image.Image) -> int:
    """The orientation of an image Pillow has opened, from what it read with the header: a TIFF's
    tag or the EXIF block (never `getexif()`, which decodes a PNG); raises ExifUnreadable."""
    if image.format == "TIFF":
        value = image.tag_v2.get(ORIENTATION_TAG, 1)  # type: ignore[attr-defined]
        return int(value) if isinstance(value, int) and 1 <= value <= 8 else 1
    raw = image.info.get("exif")
    return orientation_from_exif(raw) if raw else 1


def _corrupt(what: str) -> ImageError:
    return ImageError("corrupt", f"corrupt or truncated header: {what}")


# --- WebP (RFC 9649): RIFF chunks -----------------------------------------------------------


def webp_header(f: BinaryIO, size: int) -> ImageHeader:
    """Size and orientation from a WebP's RIFF chunks, seeking past the bitstream."""
    width = height = 0
    orientation, pos, wants_exif, warning = 1, 12, False, None
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
                raise _corrupt("bad VP8 start code")
            width = struct.unpack("<H", data[6:8])[0] & 0x3FFF
            height = struct.unpack("<H", data[8:10])[0] & 0x3FFF
        elif fourcc == b"VP8L" and not width:
            data = f.read(5)
            if len(data) < 5 or data[0] != 0x2F:
                raise _corrupt("bad VP8L signature")
            bits = int.from_bytes(data[1:5], "little")
            width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        elif fourcc == b"EXIF":
            try:
                orientation = orientation_from_exif(f.read(length))
            except ExifUnreadable as exc:
                warning = exc.warning()
            break
        if width and not wants_exif:
            break
        pos += 8 + length + (length & 1)
    if not width:
        raise _corrupt("no WebP image chunk")
    return ImageHeader(width, height, "WEBP", orientation, warning)


# --- ISOBMFF boxes (AVIF, HEIC, the JPEG XL container) -------------------------------------


def _boxes(f: BinaryIO, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each box in [start, end); the end is not clipped,
    so a caller can tell a box that runs past the file."""
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            return
        length, kind = struct.unpack(">I4s", head)
        offset = 8
        if length == 1:
            large = f.read(8)
            if len(large) < 8:
                raise _corrupt(f"box {kind!r} cut short")
            length, offset = struct.unpack(">Q", large)[0], 16
        elif length == 0:  # "to the end of the file"
            length = end - pos
        if length < offset:
            raise _corrupt(f"box {kind!r} declares {length} bytes")
        yield kind, pos + offset, pos + length
        pos += length


def isobmff_truncation(f: BinaryIO, size: int, fmt: str) -> str | None:
    """Why an AVIF, HEIC or JPEG XL container looks cut short: a top-level box that runs past the
    end, or no box for the pixels (`mdat`; for JPEG XL `jxlc` or the last `jxlp`), as when the
    file ends on a box boundary."""
    found = set()
    for kind, start, end in _boxes(f, 0, size):
        if end > size:
            return f"box {kind.decode('latin-1')!r} declares {end} bytes, file has {size}"
        if kind == b"jxlp" and _read(f, start, start + 4)[0] & 0x80:  # the last part's index
            kind = b"jxlc"
        found.add(kind)
    wanted = b"jxlc" if fmt == "JXL" else b"mdat"
    return None if wanted in found else f"no {wanted.decode()!r} box"


def _read(f: BinaryIO, start: int, end: int) -> bytes:
    f.seek(start)
    data = f.read(end - start)
    if len(data) < end - start:
        raise _corrupt("box cut short")
    return data


# irot (quarter turns counter-clockwise) then imir (axis 0: top-bottom flip, 1: left-right) as the
# EXIF orientation that displays the same; checked against the writers of Pillow and libheif.
_HEIF_ORIENTATION = {
    (0, None): 1,
    (0, 1): 2,
    (0, 0): 4,
    (1, None): 8,
    (1, 1): 7,
    (1, 0): 5,
    (2, None): 3,
    (2, 1): 4,
    (2, 0): 2,
    (3, None): 6,
    (3, 1): 5,
    (3, 0): 7,
}


def heif_header(f: BinaryIO, size: int, fmt: str) -> ImageHeader:
    """The primary item's size (`ispe`, cropped by `clap`) and its `irot`/`imir` transforms, from
    the `meta` box; its properties are applied in the order they are listed, as decoders do."""
    meta = next(((s, e) for kind, s, e in _boxes(f, 0, size) if kind == b"meta"), None)
    if meta is None:
        raise _corrupt("no meta box")
    primary, properties, associations = None, [], {}
    for kind, start, end in _boxes(f, meta[0] + 4, min(meta[1], size)):  # meta is a full box
        if kind == b"pitm":
            data = _read(f, start, end)
            primary = struct.unpack(">H", data[4:6])[0] if data[0] == 0 else struct.unpack(">I", data[4:8])[0]
        elif kind == b"iprp":
            for child, child_start, child_end in _boxes(f, start, end):
                if child == b"ipco":
                    properties = [(k, _read(f, s, e)) for k, s, e in _boxes(f, child_start, child_end)]
                elif child == b"ipma":
                    associations.update(_item_properties(_read(f, child_start, child_end)))
    if primary is None and len(associations) == 1:
        primary = next(iter(associations))
    width = height = 0
    turns, axis = 0, None
    for index in associations.get(primary, []) if primary is not None else []:
        if not 1 <= index <= len(properties):
            raise _corrupt(f"item property {index} does not exist")
        kind, data = properties[index - 1]
        if kind == b"ispe" and len(data) >= 12:
            width, height = struct.unpack(">II", data[4:12])
        elif kind == b"clap" and len(data) >= 16:  # the clean aperture: a crop applied before turning
            width_n, width_d, height_n, height_d = struct.unpack(">IIII", data[:16])
            if width_d and height_d:
                width, height = width_n // width_d, height_n // height_d
        elif kind == b"irot" and data:
            turns = data[0] & 3
        elif kind == b"imir" and data:
            axis = data[0] & 1
    if not width or not height:
        raise _corrupt("no image size (ispe) for the primary item")
    return ImageHeader(width, height, fmt, _HEIF_ORIENTATION[turns, axis])


def _item_properties(data: bytes) -> dict[int, list[int]]:
    """The `ipma` box: item id -> its property indices (1-based)."""
    version, flags = data[0], int.from_bytes(data[1:4], "big")
    pos, out = 8, {}
    try:
        for _ in range(struct.unpack(">I", data[4:8])[0]):
            if version < 1:
                item, pos = struct.unpack(">H", data[pos : pos + 2])[0], pos + 2
            else:
                item, pos = struct.unpack(">I", data[pos : pos + 4])[0], pos + 4
            count, pos = data[pos], pos + 1
            indices = []
            for _ in range(count):
                if flags & 1:
                    indices.append(struct.unpack(">H", data[pos : pos + 2])[0] & 0x7FFF)
                    pos += 2
                else:
                    indices.append(data[pos] & 0x7F)
                    pos += 1
            out[item] = indices
    except (IndexError, struct.error) as exc:
        raise _corrupt("ipma box cut short") from exc
    return out


# --- JPEG XL (ISO/IEC 18181): a bare codestream, or one in ISOBMFF boxes -------------------

_JXL_CODESTREAM = b"\xff\x0a"
JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
_JXL_RATIOS = {1: (1, 1), 2: (12, 10), 3: (4, 3), 4: (3, 2), 5: (16, 9), 6: (5, 4), 7: (2, 1)}
_JXL_HEAD_BYTES = 64  # SizeHeader and the start of ImageMetadata fit in far fewer


def is_jxl(head: bytes) -> bool:
    """Whether the file's first 12 bytes start a JPEG XL codestream or container."""
    return head.startswith(_JXL_CODESTREAM) or head.startswith(JXL_CONTAINER)


class _Bits:
    """Least-significant-bit-first reader, as the JPEG XL headers are written."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, count: int) -> int:
        value = 0
        for i in range(count):
            if self.pos >> 3 >= len(self.data):
                raise _corrupt("JPEG XL header cut short")
            value |= ((self.data[self.pos >> 3] >> (self.pos & 7)) & 1) << i
            self.pos += 1
        return value

    def u32_size(self) -> int:
        return self.u((9, 13, 18, 30)[self.u(2)]) + 1


def _jxl_size_and_orientation(code: bytes) -> tuple[int, int, int]:
    """SizeHeader and ImageMetadata.orientation of a codestream that starts with FF 0A."""
    bits = _Bits(code[2:])
    small = bits.u(1)
    height = 8 * (bits.u(5) + 1) if small else bits.u32_size()
    ratio = bits.u(3)
    if ratio:
        num, den = _JXL_RATIOS[ratio]
        width = height * num // den
    else:
        width = 8 * (bits.u(5) + 1) if small else bits.u32_size()
    orientation = 1
    if not bits.u(1) and bits.u(1):  # not all_default, extra_fields
        orientation = 1 + bits.u(3)
    return width, height, orientation


def jxl_header(f: BinaryIO, size: int) -> ImageHeader:
    """Size after the codestream's orientation (libjxl applies it when decoding), and the
    orientation of an Exif box (Pillow reports it; stk applies it like a JPEG's)."""
    head = f.read(len(JXL_CONTAINER))
    code, exif = b"", None
    if head.startswith(_JXL_CODESTREAM):
        f.seek(0)
        code = f.read(_JXL_HEAD_BYTES)
    elif head == JXL_CONTAINER:
        for kind, start, end in _boxes(f, 0, size):
            if kind == b"jxlc" and not code:
                code = _read(f, start, min(end, start + _JXL_HEAD_BYTES, size))
            elif kind == b"jxlp" and not code:
                code = _read(f, start + 4, min(end, start + 4 + _JXL_HEAD_BYTES, size))
            elif kind == b"Exif":
                exif = _read(f, start, min(end, size))
            if code and exif is not None:
                break
    if not code.startswith(_JXL_CODESTREAM):
        raise _corrupt("no JPEG XL codestream")
    width, height, coded = _jxl_size_and_orientation(code)
    if coded > 4:
        width, height = height, width
    orientation, warning = 1, None
    if exif is not None:
        # a 4-byte offset to the TIFF header comes first, which some writers leave out; Pillow's
        # plugin accepts both, and so does this
        tiff = exif[4:] if exif[4:8] in _TIFF_HEADERS else exif
        try:
            orientation = orientation_from_exif(tiff)
        except ExifUnreadable as exc:
            warning = exc.warning()
    return ImageHeader(width, height, "JXL", orientation, warning)
