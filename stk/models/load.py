"""Loading a model's encoders on a device, with the family's own recipe."""

from __future__ import annotations

import torch

from stk.models.base import Encoders
from stk.models.families import Family, detect_family, spec_for

__all__ = ["compute_dtype", "load_encoders"]


def compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (fp16 overflows in SDXL's VAE), float32 elsewhere (CPUs lack fast half precision)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_encoders(
    model: str,
    family: Family | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Encoders:
    """The VAE and text encoders of `model` (a local diffusers directory or a hub id), frozen for inference.

    `family` defaults to the one model_index.json names; `device` to the current CUDA device, else the CPU; `dtype`
    to `compute_dtype(device)`. The meta `device` asks for the encoders' identity only (`Encoders.config()`): the VAE
    loads on the CPU, the text encoders are built without their weights, whose digests their files give.
    """
    family = Family(family) if family is not None else detect_family(model)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = compute_dtype(device)
    return spec_for(family).text.encoders.load(model, device, dtype)


def quiet_model_libraries() -> None:
    """Commands report their own progress: silence the model libraries' bars and notices."""
    import diffusers
    import huggingface_hub
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
