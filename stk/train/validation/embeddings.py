"""The embeddings stk-train needs besides its dataset's: the validation prompts' and the empty caption's.

Each is embedded once. stk-cache stores the empty caption in every cache and the prompts it is given
(`stk-cache --validation-prompts`), keyed like any caption, so a run on such a cache loads no text encoder at all;
whatever the cache lacks is encoded with the model's text encoders, which are freed before training starts.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import torch

from stk.models import Encoders

__all__ = ["Embeddings", "embed_captions"]

Embeddings = dict[str, dict[str, torch.Tensor]]  # caption -> its arrays (sequences (L, D), pooled (D,)), float32


def embed_captions(
    captions: list[str],
    cached: Callable[[str], dict[str, np.ndarray] | None],
    load_encoders: Callable[[], Encoders],
) -> Embeddings:
    """Every caption's embedding: `cached(caption)` (its arrays) where the cache holds it, else encoded by the
    encoders that `load_encoders()` gives, which are dropped (and their GPU memory returned) before this returns."""
    out: Embeddings = {}
    for caption in dict.fromkeys(captions):
        found = cached(caption)
        if found is not None:
            out[caption] = _tensors(found)
    missing = [c for c in dict.fromkeys(captions) if c not in out]
    if missing:
        encoders = load_encoders()
        for caption, embedding in zip(missing, encoders.encode_text(missing), strict=True):
            out[caption] = _tensors(embedding.arrays)
        del encoders
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array).float() for name, array in arrays.items()}
