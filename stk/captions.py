"""Captions: from a table column, a sidecar file with the image's stem, or the file name."""

from __future__ import annotations

import enum
import os
import posixpath
from collections.abc import Sequence

__all__ = [
    "CAPTION_EXTENSIONS",
    "CaptionError",
    "CaptionSource",
    "MissingCaption",
    "caption_from_filename",
    "caption_from_stem",
    "decode_caption",
    "sidecar_of",
    "sidecar_stem",
]

CAPTION_EXTENSIONS = (".txt", ".caption")  # in order of preference


class MissingCaption(str, enum.Enum):
    """What to do for an image with no caption anywhere."""

    ERROR = "error"
    EMPTY = "empty"
    FILENAME = "filename"


class CaptionSource(str, enum.Enum):
    """Where a dataset's captions come from."""

    SIDECAR = "sidecar"  # a table's caption column, else the sidecar file, else MissingCaption
    STEM = "stem"  # every image's file stem, '_' as a space (SimpleTuner's caption_strategy filename)


class CaptionError(Exception):
    """No caption may be used; `kind` is the error row's kind."""

    def __init__(self, message: str, kind: str = "caption_unreadable") -> None:
        super().__init__(message)
        self.kind = kind


def sidecar_stem(key: str) -> str:
    """The key without its extension: `a/b/cat.jpg` and `a/b/cat.txt` share `a/b/cat`."""
    return posixpath.splitext(key)[0]


def sidecar_of(key: str, extensions: Sequence[str]) -> tuple[str, int] | None:
    """The stem `key` is the sidecar caption of and its extension's place in `extensions` (the first is preferred),
    or None where it is none: `a/cat.caption` is `a/cat`'s with ".caption". Extensions match in any case."""
    lowered = key.lower()
    for rank, extension in enumerate(extensions):
        stem = key[: -len(extension)]
        if lowered.endswith(extension.lower()) and stem and not stem.endswith("/"):
            return stem, rank
    return None


def caption_from_filename(key: str) -> str:
    stem = os.path.splitext(posixpath.basename(key))[0]
    return " ".join(stem.replace("_", " ").replace("-", " ").split())


def caption_from_stem(key: str) -> str:
    """SimpleTuner's filename caption: the file's stem with each '_' a space, nothing else changed
    (`a_red-car.jpg` is "a red-car")."""
    return os.path.splitext(posixpath.basename(key))[0].replace("_", " ")


def decode_caption(data: bytes) -> str:
    """UTF-8 (a BOM is dropped), surrounding whitespace stripped; anything else is an error."""
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError as exc:
        raise CaptionError(f"caption is not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 4]!r})") from exc
