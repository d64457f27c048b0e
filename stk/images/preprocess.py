"""Image -> the pixels a VAE encodes: decode, EXIF orientation, resize to cover the bucket,
crop to it. The crop offsets and the original size are returned because SDXL conditions on them.

Random crops are drawn from a generator seeded by the image's key, so the same image gets the
same crop on any rank and in any rerun.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from stk.errors import StkError, described
from stk.images.formats import open_image
from stk.images.headers import SWAPS_AXES, ExifUnreadable, image_orientation

__all__ = ["CropMode", "PreprocessError", "Preprocessed", "preprocess"]


class CropMode(str, enum.Enum):
    CENTER = "center"
    RANDOM = "random"


class PreprocessError(Exception):
    """The image cannot be decoded into pixels (corrupt data past the header, say); `kind` is the
    error row's kind: decode_failed, or out_of_memory (not held against the file on a rerun)."""

    def __init__(self, message: str, kind: str = "decode_failed") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Preprocessed:
    pixels: np.ndarray  # (3, H, W) float32 in [-1, 1], H x W = the bucket
    original_size: tuple[int, int]  # (height, width) after EXIF orientation
    crop_top_left: tuple[int, int]  # (top, left) in the resized image


def _crop_offsets(excess_h: int, excess_w: int, mode: CropMode, seed: str) -> tuple[int, int]:
    if mode is CropMode.CENTER:
        return excess_h // 2, excess_w // 2
    rng = random.Random(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    return rng.randint(0, excess_h), rng.randint(0, excess_w)


def _orientation(image: Image.Image) -> int:
    """The orientation the scan read; 1 for an EXIF block that cannot be read, as the scan assumed."""
    try:
        return image_orientation(image)
    except ExifUnreadable:
        return 1


def preprocess(f: BinaryIO, bucket_width: int, bucket_height: int, crop: CropMode, seed: str) -> Preprocessed:
    """Decode `f` and fit it to the bucket. Raises PreprocessError for any undecodable image."""
    try:
        source = open_image(f)
        width, height = source.size
        orientation = _orientation(source)
        if orientation in SWAPS_AXES:
            width, height = height, width
        scale = max(bucket_width / width, bucket_height / height)
        # JPEG: let libjpeg decode at a reduced scale that still covers the bucket (much faster)
        source.draft("RGB", (math.ceil(source.width * scale), math.ceil(source.height * scale)))
        im = (ImageOps.exif_transpose(source) if orientation != 1 else source).convert("RGB")
    except StkError:  # the storage failed while Pillow read, not the image
        raise
    except MemoryError as exc:
        raise PreprocessError(f"out of memory decoding it ({described(exc)})", kind="out_of_memory") from exc
    except Exception as exc:  # Pillow and its plugins raise many types for bad data; all mean "cannot decode"
        raise PreprocessError(f"cannot decode: {described(exc)}") from exc
    # sizes come from the full oriented size, so the result does not depend on the draft scale
    oriented_w, oriented_h = width, height
    scale = max(bucket_width / oriented_w, bucket_height / oriented_h)
    resized_w = max(bucket_width, round(oriented_w * scale))
    resized_h = max(bucket_height, round(oriented_h * scale))
    im = im.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    top, left = _crop_offsets(resized_h - bucket_height, resized_w - bucket_width, crop, seed)
    im = im.crop((left, top, left + bucket_width, top + bucket_height))
    pixels = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    return Preprocessed(np.ascontiguousarray(pixels), (oriented_h, oriented_w), (top, left))
