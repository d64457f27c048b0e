"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import EulerDiscreteScheduler

from stk.models import tinyparts as tiny
from stk.models.families.sd import SD_BETAS

__all__ = ["build"]


def build(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    # Unequal widths (32 + 64) so a swapped or missing encoder shows in the shapes; tokenizer_2 pads with "!" as
    # SDXL's does, so lengths must come from the attention mask.
    tokenizer, tokenizer_2 = (
        tiny.clip_tokenizer(scratch / "tokenizer"),
        tiny.clip_tokenizer(scratch / "tokenizer_2", "!"),
    )
    time_embed_dim = 8
    unet = unet or tiny.unet(
        32 + 64,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + 64,  # 6 size/crop numbers + pooled
        use_linear_projection=True,
    )
    # the UNet reads both encoders' hidden states side by side, and the second one's pooled output
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
    return dict(
        vae=vae or tiny.vae(4, 0.13025),
        text_encoder=tiny.clip(tokenizer, unet.config.cross_attention_dim - pooled),
        text_encoder_2=tiny.clip(tokenizer_2, pooled, projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading", steps_offset=1),
        add_watermarker=False,
    )
