"""How a VAE's latents are normalised for the denoiser: the one home of that math.

A VAE's latent distribution is not what a denoiser trains on: diffusers pipelines normalise it first,
`latents = (sample - shift) * scale`. SD and SDXL scale by the VAE's scalar `scaling_factor`, Flux also
shifts by its `shift_factor`; a VAE with per-channel statistics (`latents_mean`/`latents_std`, as
Qwen-Image's) shifts each channel by its mean and scales it by 1/std, over 4-D (B, C, h, w) or 5-D
(B, C, T, h, w) latents. FLUX.2's statistics are those of its latents' 2x2 patches folded into channels
(`patch` 2: C * 4 values, channel c's patch position (dy, dx) at c * 4 + dy * 2 + dx, as diffusers'
`_patchify_latents` folds them); the latents keep their (B, C, h, w) layout, each position normalised by its
patch channel's values, which is the pipeline's patchify, normalise, unpatchify. stk-cache stores latents
unnormalised (so a cache does not depend on the normalisation) and records the normalisation in the cache
config; stk-train applies it each step.

Cheap to import (no torch at import time): the cache config, which stk-cache and stk-train read, holds one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["LatentNorm"]


@dataclass(frozen=True)
class LatentNorm:
    """Scalar: `latents = (sample - shift_factor) * scaling_factor` (no shift: None). Per channel (axis 1):
    `latents = (sample - mean) * (1 / std)`, as diffusers' pipelines compute it; with `patch` p > 1, per channel of
    the p x p patches folded into channels (C * p * p values)."""

    scaling_factor: float | None = None
    shift_factor: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    patch: int = 1

    def __post_init__(self) -> None:
        if (self.scaling_factor is None) == (self.mean is None) or (self.mean is None) != (self.std is None):
            raise ValueError("a latent norm is a scaling_factor, or a mean and std per channel")
        if self.patch < 1 or (self.patch > 1 and self.mean is None):
            raise ValueError("a latent norm's patch is a positive size, of per-channel statistics")

    @staticmethod
    def from_vae_config(config: Mapping[str, Any]) -> LatentNorm:
        """The normalisation a diffusers VAE config declares (or a cache config records, under the same names):
        per-channel `latents_mean`/`latents_std` (of `latents_patch_size` patches) when it has them, else
        `scaling_factor` and `shift_factor`."""
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if mean is not None and std is not None:
            patch = int(config.get("latents_patch_size", 1))
            return LatentNorm(mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std), patch=patch)
        shift = config.get("shift_factor")
        return LatentNorm(float(config["scaling_factor"]), None if shift is None else float(shift))

    def to_json(self) -> dict[str, Any]:
        """As a cache config records it, under the VAE config's names."""
        if self.scaling_factor is None:
            patch = {"latents_patch_size": self.patch} if self.patch > 1 else {}
            return {"latents_mean": list(self.mean or ()), "latents_std": list(self.std or ()), **patch}
        return {"scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor}

    def normalize(self, sample: torch.Tensor) -> torch.Tensor:
        """What the denoiser sees, from a sample of the VAE's latent distribution (B, C, ...)."""
        if self.scaling_factor is None:
            mean, std = _per_channel(self.mean, sample, self.patch), _per_channel(self.std, sample, self.patch)
            return (sample - mean) * (1.0 / std)
        if self.shift_factor is not None:
            sample = sample - self.shift_factor
        return sample * self.scaling_factor


def _per_channel(values: Sequence[float] | None, latents: torch.Tensor, patch: int = 1) -> torch.Tensor:
    """One value per channel, shaped (1, C, 1, ...) to broadcast over 4-D or 5-D latents; with p x p patches, the
    C * p * p values tiled over the (B, C, h, w) latents' positions, shaped (1, C, h, w)."""
    values = values or ()
    fits = latents.ndim in (4, 5) and latents.shape[1] * patch * patch == len(values)
    if patch > 1:
        fits = fits and latents.ndim == 4 and latents.shape[2] % patch == 0 and latents.shape[3] % patch == 0
    if not fits:
        of = f" of {patch}x{patch} patches" if patch > 1 else ""
        raise ValueError(f"{len(values)} per-channel values{of} do not fit latents shaped {tuple(latents.shape)}")
    table = latents.new_tensor(values)
    if patch == 1:
        return table.reshape((1, len(values)) + (1,) * (latents.ndim - 2))
    _, channels, h, w = latents.shape
    return table.reshape(1, channels, patch, patch).repeat(1, 1, h // patch, w // patch)
