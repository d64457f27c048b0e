"""The two kinds of record a cache holds, as the writer takes them and the reader returns them: one image's
latent, and one caption's text embedding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LatentRecord", "TextRecord"]


@dataclass
class LatentRecord:
    """One image's cached latent. Arrays keep the dtype they were given (float16 by default)."""

    key: str  # latent key (hex string, <= 64 characters)
    text_key: str  # key of its caption's text embedding
    mean: np.ndarray  # (C, h, w)
    logvar: np.ndarray | None  # same shape and dtype; only when the cache stores distribution parameters
    original_size: tuple[int, int]  # (height, width) of the image after EXIF orientation, before resize
    crop_top_left: tuple[int, int]  # (top, left) crop offsets in the resized image
    path: str  # the scan table's path (for errors and verify)


@dataclass
class TextRecord:
    """One caption's text-encoder outputs, e.g. {"prompt_embeds": (L, D), "pooled_prompt_embeds": (D,)}."""

    key: str
    arrays: dict[str, np.ndarray]
    length: int  # real tokens
