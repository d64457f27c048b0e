"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["build"]


def build(scratch: Path, denoiser: Any = None, vae: Any = None) -> dict[str, Any]:
    """TODO: the pipeline's components, tiny and random (stk.models.tinyparts has tokenizers, encoders and VAEs); the
    `denoiser` and `vae` given where not None (the benchmarks pass the published ones), tokenizer files in `scratch`."""
    raise NotImplementedError
