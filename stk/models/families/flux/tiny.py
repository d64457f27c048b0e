"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

from stk.models import tinyparts as tiny
from stk.models.families.flux import T5_MAX_LENGTH

__all__ = ["build"]


# the tiny transformer's blocks and widths (16 latent channels packed 2x2); Chroma's are Flux's
TINY_BLOCKS: dict[str, Any] = dict(
    patch_size=1,
    in_channels=4 * 16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    axes_dims_rope=(4, 6, 6),
)


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.clip_tokenizer(scratch / "tokenizer")
    tokenizer_2 = tiny.t5_tokenizer(scratch / "tokenizer_2", T5_MAX_LENGTH)
    t5 = tiny.t5(tokenizer_2, transformer.config.joint_attention_dim if transformer is not None else 48)
    transformer = transformer or FluxTransformer2DModel(
        **TINY_BLOCKS,
        joint_attention_dim=t5.config.d_model,
        pooled_projection_dim=32,  # CLIP width
        guidance_embeds=True,  # like FLUX.1-dev
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae or tiny.vae(16, 0.3611, shift_factor=0.1159),
        text_encoder=tiny.clip(tokenizer, transformer.config.pooled_projection_dim),
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
