"""stk.models.latents: the latent normaliser, scalar and per channel."""

from __future__ import annotations

import pytest
import torch

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
