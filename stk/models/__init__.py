"""The one place that knows each model family (SD 1.x/2.x, SDXL, Flux): how to recognise it, which VAE and text
encoders it has, how its pipeline turns captions into embeddings, and how its latents are scaled.

`import stk.models` stays cheap: torch, diffusers and transformers load on first use of what needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stk.models.detect import Family, detect_family

if TYPE_CHECKING:
    from stk.models.base import Encoders, TextEmbedding
    from stk.models.load import load_encoders, quiet_model_libraries
    from stk.models.tiny import build_tiny_model

__all__ = [
    "Encoders",
    "Family",
    "TextEmbedding",
    "build_tiny_model",
    "detect_family",
    "load_encoders",
    "quiet_model_libraries",
]

_LAZY = {
    "Encoders": "stk.models.base",
    "TextEmbedding": "stk.models.base",
    "load_encoders": "stk.models.load",
    "quiet_model_libraries": "stk.models.load",
    "build_tiny_model": "stk.models.tiny",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
