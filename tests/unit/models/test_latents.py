"""stk.models.latents: the latent normaliser, scalar, per channel, and per channel of 2x2 patches."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from stk.models.latents import LatentNorm


def test_latent_norm_scalar_and_per_channel() -> None:
    """Scalar: bit for bit what the trainer always computed; per channel (a VAE with latents_mean/latents_std):
    diffusers' own formula over 4-D and 5-D latents."""
    sample = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    flux = LatentNorm.from_vae_config({"scaling_factor": 0.3611, "shift_factor": 0.1159, "latent_channels": 4})
    assert torch.equal(flux.normalize(sample), (sample - 0.1159) * 0.3611)
    sd = LatentNorm.from_vae_config({"scaling_factor": 0.18215})
    assert torch.equal(sd.normalize(sample), sample * 0.18215) and sd.shift_factor is None
    assert LatentNorm.from_vae_config(flux.to_json()) == flux
    assert flux.to_json() == {"scaling_factor": 0.3611, "shift_factor": 0.1159}

    mean, std = [0.1, -0.2, 0.3, 0.0], [2.0, 0.5, 1.0, 4.0]
    channels = LatentNorm.from_vae_config({"latents_mean": mean, "latents_std": std})
    assert LatentNorm.from_vae_config(channels.to_json()) == channels
    for latents in (sample, sample.reshape(2, 4, 1, 3, 5)):  # (B, C, h, w) and (B, C, T, h, w)
        shape = (1, 4) + (1,) * (latents.ndim - 2)
        want = (latents - torch.tensor(mean).view(shape)) * (1.0 / torch.tensor(std).view(shape))
        assert torch.equal(channels.normalize(latents), want)
    with pytest.raises(ValueError, match="4 per-channel values do not fit latents shaped \\(4, 3, 5\\)"):
        channels.normalize(sample[0])
    with pytest.raises(ValueError, match="a scaling_factor, or a mean and std"):
        LatentNorm(scaling_factor=0.5, mean=(0.0,), std=(1.0,))


def test_latent_norm_per_channel_of_patches_is_patchify_normalise_unpatchify() -> None:
    """Statistics of 2x2 patches folded into channels (FLUX.2's VAE): each position normalised by its patch channel's
    values, as diffusers' pipelines patchify, normalise per channel and unpatchify; the layout stays (B, C, h, w)."""
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 3, 4, 6, generator=g)
    mean, std = torch.randn(12, generator=g), torch.rand(12, generator=g) + 0.5
    norm = LatentNorm(mean=tuple(mean.tolist()), std=tuple(std.tolist()), patch=2)
    patched = Flux2KleinPipeline._patchify_latents(sample)
    want = Flux2KleinPipeline._unpatchify_latents((patched - mean.view(1, 12, 1, 1)) / std.view(1, 12, 1, 1))
    torch.testing.assert_close(norm.normalize(sample), want)
    assert LatentNorm.from_vae_config(norm.to_json()) == norm and norm.to_json()["latents_patch_size"] == 2
    with pytest.raises(ValueError, match="12 per-channel values of 2x2 patches do not fit latents shaped"):
        norm.normalize(sample[:, :, :3])
    with pytest.raises(ValueError, match="12 per-channel values of 2x2 patches do not fit latents shaped"):
        norm.normalize(torch.randn(2, 12, 4, 6))
    with pytest.raises(ValueError, match="a positive size, of per-channel statistics"):
        LatentNorm(scaling_factor=0.5, patch=2)
