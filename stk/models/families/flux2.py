"""What the FLUX.2 families (FLUX.2-dev and FLUX.2-klein) share, as diffusers' Flux2Pipeline and Flux2KleinPipeline
and their training examples (examples/dreambooth/train_dreambooth_lora_flux2.py, train_dreambooth_lora_flux2_klein.py)
do it: the VAE, the latents' normalisation, packing and position ids, and the transformer's training call.

- Latents: AutoencoderKLFlux2's distribution is patchified 2x2 (32 channels -> 128 at half the size) and normalised
  by the VAE's batch-norm running statistics, `(x - running_mean) / sqrt(running_var + batch_norm_eps)` per patch
  channel (the example's `latents_bn_mean`/`latents_bn_std`). stk keeps latents in the VAE's (B, C, h, w) layout and
  normalises each position by its patch channel's statistics (LatentNorm with patch 2): the same numbers.
- Loss: noisy = (1 - sigma) x + sigma n; the transformer takes the 2x2 patches packed into tokens (B, h/2 * w/2,
  4C), the timestep sigma (the example's `timesteps / 1000`), the text ids (0, 0, 0, l) and the image ids
  (0, row, column, 0); target noise - latents, compared in the packed layout (the example unpacks the prediction
  instead: the same elements). A guidance-distilled transformer (FLUX.2-dev: `guidance_embeds`) takes the guidance
  scale too. The example's default weighting ("none") weighs every sample alike.
- Text: the pipeline stacks the hidden states of three layers of its text encoder along the features, every one of
  the max_sequence_length positions (the transformer attends to the padding: no mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from stk.models.base import Encoders
from stk.models.latents import LatentNorm

if TYPE_CHECKING:
    from stk.models.families.spec import DenoiseSettings
    from stk.train.batch import StepInputs

__all__ = [
    "LORA_TARGETS",
    "MAX_SEQUENCE_LENGTH",
    "PATCH",
    "VAE_CLASS",
    "Flux2Encoders",
    "denoise",
    "pack",
    "patchify",
    "stacked_hidden_states",
    "tiny_transformer",
    "tiny_vae",
]

PATCH = 2  # the pipelines' _patchify_latents folds 2x2 latent patches into channels; the transformer's patch is 1
MAX_SEQUENCE_LENGTH = 512  # the pipelines' default max_sequence_length
VAE_CLASS = AutoencoderKLFlux2

# The examples' default target_modules: the double blocks' attention projections (`to_q/k/v`, `to_out.0`), the single
# blocks' fused input projection (`to_qkv_mlp_proj`) and their output projection, which the examples list by index
# (`single_transformer_blocks.{i}.attn.to_out`, i < 48 for dev, < 24 for klein). `attn.to_out` names those at any
# depth: in the double blocks it is a list, which stk.train.lora.add_lora leaves out.
LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out")


class Flux2Encoders(Encoders):
    """What the FLUX.2 families' encoders share: the VAE's normalisation, its batch norm's running statistics over
    2x2 patches, as the example computes `latents_bn_mean` and `latents_bn_std`."""

    def _latent_norm(self) -> LatentNorm:
        bn = self.vae.bn
        mean = bn.running_mean.detach().float().cpu()
        std = torch.sqrt(bn.running_var.detach().float().cpu() + self.vae.config.batch_norm_eps)
        return LatentNorm(mean=tuple(mean.tolist()), std=tuple(std.tolist()), patch=PATCH)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), the pipelines' _patchify_latents."""
    patched: torch.Tensor = Flux2KleinPipeline._patchify_latents(latents)
    return patched


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): patchified, then each position one token (the pipelines' _pack_latents)."""
    packed: torch.Tensor = Flux2KleinPipeline._pack_latents(patchify(latents))
    return packed


def stacked_hidden_states(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The pipelines' prompt embeddings: the (B, L, D) hidden states of `layers`, side by side -> (B, L, len * D)."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)
    b, n, length, width = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * width)


def denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The packed (B, h/2 * w/2, 4C) prediction of noise - latents, with the ids (and guidance) the pipelines give."""
    module: Any = getattr(denoiser, "module", denoiser)  # a DeepSpeed engine holds the model as .module
    b, device = noisy.shape[0], noisy.device
    guidance = torch.full((b,), objective.guidance_scale, device=device) if module.config.guidance_embeds else None
    prompt_embeds = inputs.text["prompt_embeds"]
    prediction: torch.Tensor = denoiser(
        hidden_states=pack(noisy),
        timestep=sigmas,  # the example's timesteps / 1000, with timesteps = 1000 sigma
        guidance=guidance,
        encoder_hidden_states=prompt_embeds,
        txt_ids=Flux2KleinPipeline._prepare_text_ids(prompt_embeds).to(device),
        img_ids=Flux2KleinPipeline._prepare_latent_ids(patchify(noisy)).to(device),
        return_dict=False,
    )[0]
    return prediction


def tiny_vae(latent_channels: int = 8) -> AutoencoderKLFlux2:
    """Four blocks like the real one (8x down); random batch-norm statistics, so that normalising shows."""
    vae = AutoencoderKLFlux2(block_out_channels=(32, 64, 64, 64), layers_per_block=1, latent_channels=latent_channels,
                             sample_size=64)  # fmt: skip
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    return vae


def tiny_transformer(latent_channels: int, text_width: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """One double and two single blocks of width 32 (two heads of 16), reading 2x2 patches of `latent_channels`."""
    return Flux2Transformer2DModel(
        in_channels=PATCH * PATCH * latent_channels,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_width,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head width
        guidance_embeds=guidance_embeds,
    )
