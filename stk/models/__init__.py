"""Models: what every family shares (the VAE and text encoders behind `Encoders`, loading, tiny and published
pipelines) and, in stk.models.families, what each family is: one module and one registry entry per family.

`import stk.models` stays cheap: torch, diffusers and transformers load on first use of what needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stk.models.families import Family, detect_family

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
