"""Cache keys: what identifies a latent and a text embedding.

A latent is keyed by the image's identity (path, size, mtime) plus everything that changes its
pixels or its encoding (bucket, crop, stored form, VAE); a text embedding by the caption plus
the text encoders, so a caption used by 10,000 images is encoded and stored once. The recipes
are stored in the manifest, so keys can be recomputed from a scan table without the models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

__all__ = ["digest", "latent_key", "latent_keys", "text_key"]

KEY_CHARS = 40


def digest(value: Any) -> str:
    """A stable hex digest of any JSON-able value."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def latent_key(row: dict[str, Any], recipe: dict[str, Any]) -> str:
    identity = (row["path"], row["bytes"], row["mtime"], row["bucket_width"], row["bucket_height"])
    return latent_keys([identity], recipe)[0]


def latent_keys(identities: Iterable[tuple[Any, ...]], recipe: dict[str, Any]) -> list[str]:
    """`digest([identity, recipe])` of many rows at once, each identity given as (path, bytes, mtime, bucket_width,
    bucket_height): the recipe is encoded once, which is most of the time a key takes; the text hashed is the one
    `digest` would encode."""
    encode = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode
    tail = "," + encode(recipe) + "]"
    return [hashlib.sha256(("[" + encode(list(i)) + tail).encode()).hexdigest()[:KEY_CHARS] for i in identities]


def text_key(caption: str, recipe: dict[str, Any]) -> str:
    return digest([caption, recipe])[:KEY_CHARS]
