"""The published architectures stk trains: SD 1.5, SDXL base and FLUX.1-dev, each one's denoiser and VAE as the
config.json of its hub repository (stk/models/configs/NAME/{denoiser,vae}.json). With them the benchmarks, the GPU
kit and the memory tables build the real architectures with random weights, offline."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch

from stk.models.families import Family, all_specs

__all__ = ["PUBLISHED", "build_published", "published_config"]

# config folder name -> family, from each family's spec (`FamilySpec.published`)
PUBLISHED: dict[str, Family] = {name: spec.name for spec in all_specs() for name in spec.published}
COMPONENTS = ("denoiser", "vae")


def published_config(name: str, component: str, **overrides: Any) -> dict[str, Any]:
    """The published config of `name`'s `component` (denoiser or vae), with `overrides` applied (fewer blocks for a
    GPU that holds fewer). Keys starting with '_' are the file's own (the class name)."""
    if name not in PUBLISHED or component not in COMPONENTS:
        raise ValueError(f"no published config {name}/{component}: choose one of {sorted(PUBLISHED)} / {COMPONENTS}")
    text = resources.files("stk.models").joinpath("configs", name, f"{component}.json").read_text(encoding="utf-8")
    return {**json.loads(text), **overrides}


def build_published(config: dict[str, Any], device: str | torch.device = "meta") -> torch.nn.Module:
    """The module a published config describes, with random weights, built on `device` (meta: no memory)."""
    import diffusers

    model_class = getattr(diffusers, config["_class_name"])
    with torch.device(device):
        return model_class.from_config(config)
