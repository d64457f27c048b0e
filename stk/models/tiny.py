"""Random-weight pipelines of each family, laid out and loaded exactly like the real models (model_index.json and one
subfolder per component, denoiser included), built offline: tiny ones for tests and the demo (about a second), and
ones with a published denoiser and VAE (stk.models.published) and tiny text encoders of the widths that denoiser
reads, for benchmarks on real architectures (text embeddings are cached, so their encoders' depth does not matter).
Each family's folder holds the builder of its components (`build` in stk/models/families/<name>/tiny.py, from
stk.models.tinyparts)."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import Any

import torch

from stk.models.families import Family, spec_for
from stk.models.families.registry import module_name
from stk.models.families.spec import TinyBuilder
from stk.models.published import PUBLISHED, build_published, published_config

__all__ = ["build_published_model", "build_tiny_model", "tiny_builder"]


def tiny_builder(family: Family) -> TinyBuilder:
    """`build` of the family's tiny.py: found by the folder's layout, so the spec need not import test-only code."""
    builder: TinyBuilder = importlib.import_module(f"stk.models.families.{module_name(family)}.tiny").build
    return builder


def build_tiny_model(family: Family, out_dir: str, seed: int = 0) -> str:
    """Write a tiny `family` pipeline with random weights (deterministic for a seed) into out_dir; returns out_dir.
    Leaves the caller's torch random state as it was."""
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(seed)
        spec = spec_for(family)
        spec.pipeline_class(**tiny_builder(spec.name)(Path(scratch), None, None)).save_pretrained(out_dir)
    return out_dir


def build_published_model(
    name: str,
    out_dir: str,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    denoiser: dict[str, Any] | None = None,
    vae: dict[str, Any] | None = None,
) -> str:
    """Write a pipeline with `name`'s published denoiser and VAE (their configs changed by the `denoiser` and `vae`
    overrides: fewer blocks, say), random weights in `dtype` (built on `device`: a GPU draws billions of weights in
    seconds), and tiny text encoders of the widths the denoiser reads, into out_dir; returns out_dir."""
    spec = spec_for(PUBLISHED[name])
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(seed)
        denoiser_module = build_published(published_config(name, "denoiser", **(denoiser or {})), device).to(dtype)
        vae_module = build_published(published_config(name, "vae", **(vae or {})), device).to(dtype)
        spec.pipeline_class(**tiny_builder(spec.name)(Path(scratch), denoiser_module, vae_module)).save_pretrained(
            out_dir
        )
    return out_dir
