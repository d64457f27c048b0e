"""The JSON files of a diffusers pipeline (model_index.json, each component's config.json), read without weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stk.errors import InputError
from stk.models.families.registry import family_hint

__all__ = ["read_model_json", "scale_factor_of", "vae_scale_factor"]


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
                f"or {family_hint()} with a model that is in the hub cache"
            ) from exc
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    return data


def scale_factor_of(vae_config: dict[str, Any]) -> int:
    """Pixels per latent along each side, as diffusers pipelines compute it: 2 ** (VAE blocks - 1), or for a video
    VAE 2 ** its downsampling stages (`temperal_downsample`, one flag per stage for the time axis)."""
    if "temperal_downsample" in vae_config:
        return int(2 ** len(vae_config["temperal_downsample"]))
    return int(2 ** (len(vae_config["block_out_channels"]) - 1))


def vae_scale_factor(model: str) -> int:
    """The scale factor of `model`'s VAE (a local pipeline directory or a hub id)."""
    return scale_factor_of(read_model_json(model, "vae/config.json"))
