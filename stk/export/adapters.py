"""An adapter from its diffusers/peft file (what stk-train's final/ and a checkpoint's lora/ hold) to a format: the
same file, or kohya/ComfyUI's keys through the family's layout (`FamilySpec.kohya_lora`, stk.models.layouts)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from stk.errors import InputError
from stk.export.formats import Format
from stk.models.families import all_specs, spec_for
from stk.models.layouts import LoraLayer

__all__ = ["adapter_kind", "lora_layers", "write_adapter"]

METADATA = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
# a tensor name's mark -> the adapter type (peft's names): LoHa and LoKr are added by naming their tensors here
# (DoRA first: it is a LoRA with a magnitude vector beside it)
KINDS = {".lora_magnitude_vector": "dora", ".lora_A.": "lora", ".hada_w1_a": "loha", ".lokr_w1": "lokr"}


def _read(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys = f.keys()
        return {key: f.get_tensor(key) for key in keys}, dict(f.metadata() or {})


def adapter_kind(file: Path) -> str:
    """ "lora", "loha" or "lokr", from the tensor names peft gives each type."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys = list(f.keys())
    for mark, kind in KINDS.items():
        if any(mark in key for key in keys):
            return kind
    raise InputError(f"{file}: holds no adapter stk-export knows (LoRA, DoRA, LoHa, LoKr tensors)")


def _scale(config: dict[str, Any], file: Path) -> float:
    """alpha / rank, as peft scales the adapter (rsLoRA: alpha / sqrt(rank)); one scale for every layer."""
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise InputError(f"{file}: per-layer ranks or alphas (rank_pattern, alpha_pattern) cannot be exported yet")
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    return float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)


def _config(metadata: dict[str, str], prefix: str, file: Path) -> dict[str, Any]:
    """The adapter's LoraConfig as save_lora wrote it in the file's metadata (keys under the denoiser's name)."""
    if METADATA not in metadata:
        raise InputError(f"{file}: no adapter config in its metadata; was it written by stk-train?")
    packed = json.loads(metadata[METADATA])
    own = {key.removeprefix(prefix): value for key, value in packed.items() if key.startswith(prefix)}
    return own or packed


def lora_layers(file: Path, subfolder: str) -> dict[str, LoraLayer]:
    """The LoRA in `file` by the denoiser's layer names (`transformer.` or `unet.` taken off)."""
    state, metadata = _read(file)
    prefix = f"{subfolder}."
    scale = _scale(_config(metadata, prefix, file), file)
    layers = {}
    for key, down in state.items():
        if key.endswith(".lora_A.weight"):
            name = key.removesuffix(".lora_A.weight")
            up = state[f"{name}.lora_B.weight"]
            layers[name.removeprefix(prefix)] = LoraLayer(down=down, up=up, scale=scale)
    return layers


def write_adapter(file: Path, family: str, fmt: Format, out: Path) -> None:
    """`out` (a new file) from the adapter `file`: the same bytes for diffusers, kohya's keys for kohya."""
    if fmt is Format.DIFFUSERS:
        shutil.copyfile(file, out)
        return
    spec = spec_for(family)
    if spec.kohya_lora is None:
        have = ", ".join(s.name.value for s in all_specs() if s.kohya_lora is not None)
        raise InputError(f"--format kohya: no kohya layout for {spec.title}; families that have one: {have}")
    from safetensors.torch import save_file

    tensors = spec.kohya_lora(lora_layers(file, spec.denoiser_subfolder))
    save_file(tensors, str(out), metadata={"format": "pt"})
