"""Which model family a diffusers pipeline belongs to, from its model_index.json."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from stk.errors import InputError

__all__ = ["PIPELINE_FAMILIES", "Family", "detect_family"]


class Family(str, enum.Enum):
    SD = "sd"  # Stable Diffusion 1.x and 2.x
    SDXL = "sdxl"
    FLUX = "flux"


# model_index.json "_class_name" -> family. Variants of one pipeline share its encoders.
PIPELINE_FAMILIES: dict[str, Family] = {
    "StableDiffusionPipeline": Family.SD,
    "StableDiffusionImg2ImgPipeline": Family.SD,
    "StableDiffusionInpaintPipeline": Family.SD,
    "StableDiffusionXLPipeline": Family.SDXL,
    "StableDiffusionXLImg2ImgPipeline": Family.SDXL,
    "StableDiffusionXLInpaintPipeline": Family.SDXL,
    "FluxPipeline": Family.FLUX,
    "FluxImg2ImgPipeline": Family.FLUX,
    "FluxInpaintPipeline": Family.FLUX,
}

_FAMILY_HINT = "pass --family " + "|".join(f.value for f in Family)


def _read_model_index(model: str) -> dict[str, Any]:
    """model_index.json of a local pipeline directory, or of a hub id (through the hub cache)."""
    if Path(model).is_dir():
        path = Path(model) / "model_index.json"
        if not path.is_file():
            raise InputError(f"{model} has no model_index.json: not a diffusers pipeline directory")
    elif Path(model).exists():
        raise InputError(f"{model} is a file: give a diffusers pipeline directory or a hub id")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(model, "model_index.json"))
        except (OSError, ValueError) as exc:  # offline, unknown repo, invalid id
            raise InputError(
                f"cannot read model_index.json of {model!r} ({type(exc).__name__}): give a local model directory, "
                f"or {_FAMILY_HINT} with a model that is in the hub cache"
            ) from exc
    try:
        index: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    return index


def detect_family(model: str) -> Family:
    """The family of `model` (a local diffusers directory or a hub id), from its pipeline class."""
    name = _read_model_index(model).get("_class_name")
    family = PIPELINE_FAMILIES.get(str(name))
    if family is None:
        known = ", ".join(PIPELINE_FAMILIES)
        raise InputError(
            f"{model}: pipeline {name!r} is not one stk knows ({known}); {_FAMILY_HINT} if its VAE and text encoders "
            "are laid out like one of those"
        )
    return family
