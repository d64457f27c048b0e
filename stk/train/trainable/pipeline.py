"""The fine-tuned model as a complete diffusers pipeline: the source pipeline's components as they were, with the
trained denoiser in place of the original, ready for `DiffusionPipeline.from_pretrained`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stk.storage.failures import storage_errors
from stk.storage.modes import honour_umask

__all__ = ["export_pipeline", "replaced_on_success"]


def _components(index_path: Path, skip: str) -> list[str]:
    """The subfolders model_index.json names (components set to None have none), less `skip`."""
    index = json.loads(index_path.read_text(encoding="utf-8"))
    return [
        name
        for name, value in index.items()
        if isinstance(value, list) and value and value[0] is not None and name != skip
    ]


def _source(model: str, denoiser_subfolder: str) -> tuple[Path, list[str]]:
    """The source pipeline's folder and the components to copy. For a hub id, the snapshot in the hub cache (where
    training loaded it from); only model_index.json and those components are fetched when online, never the repo's
    other checkpoints nor the denoiser we replace."""
    if Path(model).is_dir():
        return Path(model), _components(Path(model) / "model_index.json", denoiser_subfolder)
    from huggingface_hub import hf_hub_download, snapshot_download

    components = _components(Path(hf_hub_download(model, "model_index.json")), denoiser_subfolder)
    patterns = ["model_index.json", *(f"{name}/*" for name in components)]
    return Path(snapshot_download(model, allow_patterns=patterns)), components


def export_pipeline(
    model: str,
    denoiser_subfolder: str,
    denoiser_class: type[Any],  # a diffusers model class (ModelMixin and ConfigMixin), e.g. UNet2DConditionModel
    config: dict[str, Any],  # the denoiser's diffusers config, as its `.config` holds it
    state_dict: dict[str, torch.Tensor],
    out_dir: str,
) -> str:
    """Write the pipeline `model` with `state_dict` as its denoiser to `out_dir`; returns out_dir.

    Built in a sibling temp folder and renamed into place, so `out_dir` holds either the previous export or this
    one, never half a model. The weights keep the state dict's dtype. Rank 0 only: ZeRO-3 shards are gathered first.
    """
    source, components = _source(model, denoiser_subfolder)
    with replaced_on_success(out_dir) as tmp:
        shutil.copy2(source / "model_index.json", tmp / "model_index.json")
        for name in components:
            shutil.copytree(source / name, tmp / name)  # hub snapshots hold symlinks: this copies the files
        # Built on the meta device and given the tensors themselves: no random init, no second copy of a 12B model.
        with torch.device("meta"):
            denoiser = denoiser_class.from_config(config)
        denoiser.load_state_dict(state_dict, strict=True, assign=True)
        denoiser.save_pretrained(tmp / denoiser_subfolder, safe_serialization=True)
    return out_dir


@contextmanager
def replaced_on_success(out_dir: str) -> Iterator[Path]:
    """An empty sibling folder to build in, which then replaces `out_dir` by renames: `out_dir` holds either what it
    held before or all of the new contents, never half. On an error the new folder goes and `out_dir` stays; a full
    disk is one line (InfraError)."""
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with storage_errors(out_dir):
        try:
            tmp.mkdir(parents=True)
            yield tmp
            honour_umask(tmp)  # safetensors writes 0600: a model on shared storage is for the team
            if out.exists():
                old = out.with_name(f"{out.name}.old-{os.getpid()}")
                out.rename(old)
                try:
                    tmp.rename(out)
                except BaseException:
                    old.rename(out)
                    raise
                shutil.rmtree(old)
            else:
                tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
