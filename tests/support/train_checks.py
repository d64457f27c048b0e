"""What the stk-train end-to-end tests check of a run: its checkpoints and the final diffusers model."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from stk.models import Family
from stk.models.families import spec_for
from stk.train.objective.objectives import objective_for
from support.tiny_batches import step_inputs


def denoiser_folder(family: Family) -> str:
    """The pipeline's attribute and subfolder of the family's denoiser ("unet", "transformer")."""
    return spec_for(family).denoiser.subfolder


def latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


def denoiser_weights(model_dir: Path, family: Family) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / denoiser_folder(family) / "diffusion_pytorch_model.safetensors"))


def check_final(final: Path, family: Family, trained: dict[str, torch.Tensor] | None = None) -> None:
    """The final model loads with from_pretrained and its denoiser runs a training-shaped step."""
    pipeline = DiffusionPipeline.from_pretrained(str(final))
    denoiser = getattr(pipeline, denoiser_folder(family))
    objective = objective_for(family, str(final))
    with torch.no_grad():
        loss = objective.loss(denoiser, step_inputs(family), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
