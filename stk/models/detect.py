"""Which model family a diffusers pipeline belongs to, from its model_index.json."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from stk.errors import InputError

__all__ = ["PIPELINE_FAMILIES", "Family", "detect_family", "read_model_json", "vae_scale_factor"]


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


def read_model_json(model: str, filename: str) -> dict[str, Any]:
    """A JSON file of a local pipeline directory ("model_index.json", "vae/config.json"), or of a hub
    id (through the hub cache); no weights are read."""
    if Path(model).is_dir():
        path = Path(model) / filename
        if not path.is_file():
            what = "not a diffusers pipeline directory" if filename == "model_index.json" else "incomplete pipeline"
            raise InputError(f"{model} has no {filename}: {what}")
    elif Path(model).exists():
        raise InputError(f"{model} is a file: give a diffusers pipeline directory or a hub id")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(model, filename))
        except (OSError, ValueError) as exc:  # offline, unknown repo, invalid id
            raise InputError(
                f"cannot read {filename} of {model!r} ({type(exc).__name__}): give a local model directory, "
                f"or {_FAMILY_HINT} with a model that is in the hub cache"
            ) from exc
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    return data


def vae_scale_factor(model: str) -> int:
    """Pixels per latent along each side: 2 ** (VAE blocks - 1), as diffusers pipelines compute it."""
    return int(2 ** (len(read_model_json(model, "vae/config.json")["block_out_channels"]) - 1))


def detect_family(model: str) -> Family:
    """The family of `model` (a local diffusers directory or a hub id), from its pipeline class."""
    name = read_model_json(model, "model_index.json").get("_class_name")
    family = PIPELINE_FAMILIES.get(str(name))
    if family is None:
        known = ", ".join(PIPELINE_FAMILIES)
        raise InputError(
            f"{model}: pipeline {name!r} is not one stk knows ({known}); {_FAMILY_HINT} if its VAE and text encoders "
            "are laid out like one of those"
        )
    return family
