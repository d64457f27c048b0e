"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from stk.models import tinyparts as tiny
from stk.models.families.flux2 import HIDDEN_STATES_LAYERS, MAX_SEQUENCE_LENGTH, PATCH

__all__ = ["build"]


TINY_TEXT_WIDTH = 16


def tiny_vae(latent_channels: int = 8) -> AutoencoderKLFlux2:
    """Four blocks like the real one (8x down); random batch-norm statistics, so that normalising shows."""
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 64, 64, 64), layers_per_block=1, latent_channels=latent_channels, sample_size=64
    )
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    return vae


def tiny_text_width(transformer: Any) -> int:
    """The tiny text encoder's width for `transformer`, whose text width is three of its layers side by side; for a
    tiny transformer, TINY_TEXT_WIDTH."""
    return int(transformer.config.joint_attention_dim) // 3 if transformer is not None else TINY_TEXT_WIDTH


def tiny_pipeline(
    text_encoder: Any, tokenizer: Any, transformer: Any, vae: Any, guidance_embeds: bool
) -> dict[str, Any]:
    """A FLUX.2 pipeline's components around a tiny text encoder: `transformer` and `vae` where given, else tiny
    ones; FLUX.1-dev's scheduler, as the published pipelines have it."""
    vae = vae or tiny_vae()
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer or tiny_transformer(vae.config.latent_channels, 3 * TINY_TEXT_WIDTH, guidance_embeds),
    )


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


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    """Mistral3 with a text model deep enough for layer 30 and a one-layer vision tower, all 16 wide; its tokenizer
    saved as a tokenizer (a PixtralProcessor needs torchvision), which the pipeline uses alike for text."""
    tokenizer = tiny.mistral_tokenizer(scratch / "tokenizer")
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=tiny_text_width(transformer),
        intermediate_size=32,
        head_dim=8,
        num_hidden_layers=max(HIDDEN_STATES_LAYERS) + 1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_SEQUENCE_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=56,
        patch_size=14,
    )
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=tokenizer.get_vocab()["[IMG]"])
    return tiny_pipeline(Mistral3ForConditionalGeneration(config), tokenizer, transformer, vae, guidance_embeds=True)
