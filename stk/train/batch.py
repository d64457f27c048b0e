"""What the data side hands the training step: one rank's micro-batch, from the cache or from images.

A cached batch carries latents and text embeddings; a `--vae-on-the-fly` batch carries pixels and
captions, which the step encodes with the frozen VAE and text encoders. Either way the step ends up
with the same `StepInputs`, so every family's objective sees one shape of input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch", "StepInputs"]


@dataclass
class Batch:
    """One rank's micro-batch; all samples share one bucket (one latent shape).

    From the cache: `mean` (and `logvar` when the cache stores distribution parameters) are the VAE's
    latent distribution, unscaled and unshifted, float32 (B, C, h, w); `text` holds the caption
    embeddings as float32, sequences (B, L, D) zero-padded to the batch's longest, pooled (B, D).
    From images (--vae-on-the-fly): `pixels` (B, 3, H, W) in [-1, 1] and `captions` instead.
    `original_size` and `crop_top_left` are (B, 2) int64, (height, width) and (top, left): SDXL's
    added conditioning.
    """

    keys: list[str]
    original_size: torch.Tensor
    crop_top_left: torch.Tensor
    mean: torch.Tensor | None = None
    logvar: torch.Tensor | None = None
    text: dict[str, torch.Tensor] | None = None
    pixels: torch.Tensor | None = None
    captions: list[str] | None = None

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class StepInputs:
    """What an objective trains on: latents already sampled and normalised for the denoiser
    (stk.models.latents.LatentNorm), text embeddings by name, SDXL's size conditioning;
    all on the training device, latents and text in the training dtype."""

    latents: torch.Tensor  # (B, C, h, w)
    text: dict[str, torch.Tensor]
    original_size: torch.Tensor  # (B, 2) (height, width) of the image before resize
    crop_top_left: torch.Tensor  # (B, 2) (top, left)
