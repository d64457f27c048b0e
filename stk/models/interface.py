"""What a family's code receives from the trainer, in one module below both: the step's inputs and the objective's
settings its forward pass reads. stk/train builds these; stk/models/families only reads them, so no import points up.
(The latents' normalisation, `LatentNorm`, is stk.models.latents'.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["DenoiseSettings", "StepInputs"]


@dataclass
class StepInputs:
    """What an objective trains on: latents already sampled and normalised for the denoiser
    (stk.models.latents.LatentNorm), text embeddings by name, SDXL's size conditioning;
    all on the training device, latents and text in the training dtype."""

    latents: torch.Tensor  # (B, C, h, w)
    text: dict[str, torch.Tensor]
    original_size: torch.Tensor  # (B, 2) (height, width) of the image before resize
    crop_top_left: torch.Tensor  # (B, 2) (top, left)


class DenoiseSettings(Protocol):
    """What a family's forward pass reads of the objective that calls it (stk.train.objective.objectives.Objective)."""

    @property
    def guidance_scale(self) -> float:
        """Guidance-distilled models (FLUX.1-dev) take it as an input."""

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent, for size conditioning."""
