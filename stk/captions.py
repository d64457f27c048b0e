"""Captions: from a table column, a sidecar file with the image's stem, or the file name."""

from __future__ import annotations

import enum
import os
import posixpath

__all__ = [
    "CAPTION_EXTENSIONS",
    "CaptionError",
    "MissingCaption",
    "caption_from_filename",
    "decode_caption",
    "sidecar_stem",
]

CAPTION_EXTENSIONS = (".txt", ".caption")  # in order of preference


class MissingCaption(str, enum.Enum):
    """What to do for an image with no caption anywhere."""

    ERROR = "error"
    EMPTY = "empty"
    FILENAME = "filename"


class CaptionError(Exception):
    """No caption may be used; `kind` is the error row's kind."""

    def __init__(self, message: str, kind: str = "caption_unreadable") -> None:
        super().__init__(message)
        self.kind = kind


def sidecar_stem(key: str) -> str:
    """The key without its extension: `a/b/cat.jpg` and `a/b/cat.txt` share `a/b/cat`."""
    return posixpath.splitext(key)[0]


def caption_from_filename(key: str) -> str:
    stem = os.path.splitext(posixpath.basename(key))[0]
    return " ".join(stem.replace("_", " ").replace("-", " ").split())


def decode_caption(data: bytes) -> str:
    """UTF-8 (a BOM is dropped), surrounding whitespace stripped; anything else is an error."""
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError as exc:
        raise CaptionError(f"caption is not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 4]!r})") from exc
