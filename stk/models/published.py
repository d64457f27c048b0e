"""The published architectures stk trains, each one's denoiser and VAE as the config.json of its hub repository, in its
family's folder (stk/models/families/<family>/configs/NAME/{denoiser,vae}.json; `FamilySpec.published` names them).
With them the benchmarks, the GPU kit and the memory tables build the real architectures with random weights,
offline."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch

from stk.models.families import Family, all_specs
from stk.models.families.registry import module_name

__all__ = ["PUBLISHED", "build_published", "published_config"]

# config folder name -> family, from each family's spec (`FamilySpec.published`)
PUBLISHED: dict[str, Family] = {name: spec.name for spec in all_specs() for name in spec.published}
COMPONENTS = ("denoiser", "vae")


def published_config(name: str, component: str, **overrides: Any) -> dict[str, Any]:
    """The published config of `name`'s `component` (denoiser or vae), with `overrides` applied (fewer blocks for a
    GPU that holds fewer). Keys starting with '_' are the file's own (the class name)."""
    if name not in PUBLISHED or component not in COMPONENTS:
        raise ValueError(f"no published config {name}/{component}: choose one of {sorted(PUBLISHED)} / {COMPONENTS}")
    folder = resources.files("stk.models.families").joinpath(module_name(PUBLISHED[name]), "configs", name)
    text = folder.joinpath(f"{component}.json").read_text(encoding="utf-8")
    return {**json.loads(text), **overrides}


def build_published(config: dict[str, Any], device: str | torch.device = "meta") -> torch.nn.Module:
    """The module a published config describes, with random weights, built on `device` (meta: no memory)."""
    import diffusers

    model_class = getattr(diffusers, config["_class_name"])
    with torch.device(device):
        return model_class.from_config(config)
