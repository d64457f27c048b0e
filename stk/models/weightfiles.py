"""A pipeline component's safetensors files, and a digest of its weights read from them without loading the model.

stk-train checks that a cache was made by --model's VAE and text encoders (stk/train/data/cachemodel.py) without loading
a text encoder, which may be 24B parameters: the text encoders' identity is a digest of a strided sample of each
tensor in their files, which stk-cache records and stk-train recomputes alike, reading a few kilobytes per tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from stk.errors import InputError

__all__ = ["component_folder", "files_digest", "weight_files"]

SAMPLES_PER_TENSOR = 16  # about; strided along every axis
# (single file, index of shards): diffusers' names for a model's weights, then transformers'
_NAMES = (
    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"),
    ("model.safetensors", "model.safetensors.index.json"),
)


def weight_files(folder: Path) -> list[Path] | None:
    """The component folder's safetensors files (one, or the shards its index names); None when it has none."""
    for single, index in _NAMES:
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
    return None


def component_folder(model: str, subfolder: str) -> Path | None:
    """`model`'s `subfolder` on this machine: in the directory, or for a hub id in the hub cache (fetched when
    online); None when it cannot be had, for the loader to say why in its words."""
    if Path(model).is_dir():
        return Path(model) / subfolder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=[f"{subfolder}/*"])) / subfolder
    except Exception:  # offline and not cached, no such repo
        return None


def _strided(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices that take about SAMPLES_PER_TENSOR elements evenly from a tensor of `shape`, along every axis."""
    per_axis = max(1, math.ceil(SAMPLES_PER_TENSOR ** (1 / len(shape)))) if shape else 1
    return tuple(slice(None, None, max(1, size // per_axis)) for size in shape)


def files_digest(files: list[Path], dtype: torch.dtype) -> str:
    """Digest of a strided sample of every tensor in `files`, by name, as `dtype` holds it: the same for a copy in
    another dtype or sharding, another when any trained tensor changes. Reads only the sampled elements."""
    from safetensors import safe_open

    picks: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    tensor = handle.get_slice(name)
                    shape = tuple(tensor.get_shape())
                    sample = tensor[_strided(shape)] if shape else handle.get_tensor(name)
                    picks[name] = sample.to(dtype).float().reshape(-1)
        except Exception as exc:  # safetensors' own error type for a damaged file
            raise InputError(f"cannot read {path}: {str(exc).strip().splitlines()[0]}") from exc
    samples = [picks[name] for name in sorted(picks)]
    return hashlib.sha256(torch.cat(samples).numpy().tobytes() if samples else b"").hexdigest()
