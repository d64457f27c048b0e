"""An adapter from its diffusers/peft file (what stk-train's final/ and a checkpoint's lora/ hold) to a format: the
same file, or kohya/ComfyUI's keys through the family's layout (`FamilySpec.export.kohya_lora`, stk.models.layouts). The
file is read whole and checked first: a damaged file, another family's weights or a NaN is one line, not a file."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stk.errors import InputError
from stk.export.formats import Format
from stk.export.source import check_whole
from stk.models.families import all_specs, spec_for
from stk.models.families.spec import FamilySpec
from stk.models.layouts import LoraLayer

__all__ = ["Adapter", "kohya_families", "lora_layers", "read_adapter", "write_adapter"]

METADATA = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
# a tensor name's mark -> the adapter type (peft's names): LoHa and LoKr are added by naming their tensors here
# (DoRA first: it is a LoRA with a magnitude vector beside it)
KINDS = {".lora_magnitude_vector": "dora", ".lora_A.": "lora", ".hada_w1_a": "loha", ".lokr_w1": "lokr"}


@dataclass(frozen=True)
class Adapter:
    file: Path
    kind: str  # "lora", "dora", "loha" or "lokr", from the tensor names peft gives each type
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def kohya_families() -> list[str]:
    """The families whose LoRA stk-export writes under kohya/ComfyUI's keys (`ExportSpec.kohya_lora`)."""
    return [spec.name.value for spec in all_specs() if spec.export.kohya_lora is not None]


def read_adapter(file: Path) -> Adapter:
    """The adapter in `file`; CheckpointDamaged (exit 6) for a file that is not whole safetensors (truncated, its
    header overwritten), InputError (exit 3) for one that holds no adapter stk-export knows."""
    from safetensors import safe_open

    check_whole([file])
    with safe_open(str(file), framework="pt") as f:
        keys = f.keys()  # a safe_open handle is not iterable
        tensors, metadata = {key: f.get_tensor(key) for key in keys}, dict(f.metadata() or {})
    kind = next((kind for mark, kind in KINDS.items() if any(mark in key for key in tensors)), None)
    if kind is None:
        raise InputError(f"{file}: holds no adapter stk-export knows (LoRA, DoRA, LoHa, LoKr tensors)")
    return Adapter(file, kind, tensors, metadata)


def _check_finite(tensors: dict[str, torch.Tensor], where: Path) -> None:
    """InputError naming the first tensor holding a NaN or an infinity: the training diverged, and an exported file
    would make black images in every tool that loads it."""
    bad = [name for name, tensor in tensors.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise InputError(
            f"{where}: {bad[0]} holds NaN or infinite values{more}: the training diverged there; export an earlier "
            "checkpoint"
        )


def _check_family(adapter: Adapter, spec: FamilySpec) -> None:
    """InputError where the adapter's weights are not on `spec`'s denoiser (an SDXL LoRA given --family flux: its
    keys are the UNet's, `unet.`, not the transformer's)."""
    prefix = f"{spec.denoiser.subfolder}."
    other = next((key for key in adapter.tensors if not key.startswith(prefix)), None)
    if other is not None:
        raise InputError(
            f"{adapter.file}: {other} is not a weight of {spec.title}'s {spec.denoiser.subfolder}: the adapter was "
            f"trained on another family; give its --family (or leave --family out where its run records it)"
        )


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


def lora_layers(adapter: Adapter, subfolder: str) -> dict[str, LoraLayer]:
    """The LoRA by the denoiser's layer names (`transformer.` or `unet.` taken off)."""
    state, prefix = adapter.tensors, f"{subfolder}."
    scale = _scale(_config(adapter.metadata, prefix, adapter.file), adapter.file)
    layers = {}
    for key, down in state.items():
        if key.endswith(".lora_A.weight"):
            name = key.removesuffix(".lora_A.weight")
            up = state[f"{name}.lora_B.weight"]
            layers[name.removeprefix(prefix)] = LoraLayer(down=down, up=up, scale=scale)
    return layers


def write_adapter(adapter: Adapter, family: str, fmt: Format, out: Path) -> None:
    """`out` (a new file) from `adapter`: the same bytes for diffusers, kohya's keys for kohya; refused where the
    adapter is not `family`'s or holds a NaN."""
    spec = spec_for(family)
    _check_family(adapter, spec)
    _check_finite(adapter.tensors, adapter.file)
    if fmt is Format.DIFFUSERS:
        shutil.copyfile(adapter.file, out)
        return
    if spec.export.kohya_lora is None:
        have = ", ".join(kohya_families())
        raise InputError(f"--format kohya: no kohya layout for {spec.title}; families that have one: {have}")
    from safetensors.torch import save_file

    tensors = spec.export.kohya_lora(lora_layers(adapter, spec.denoiser.subfolder))
    save_file(tensors, str(out), metadata={"format": "pt"})
