"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from stk.models import tinyparts as tiny
from stk.models.families.sd3 import PATCH, T5_MAX_LENGTH

__all__ = ["build"]


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    # CLIP-L and CLIP-G widths in the published ratio (768 + 1280 = 2048), so a published transformer gets encoders of
    # the widths it reads; tokenizer_2 pads with "!" as SD3's does.
    pooled = transformer.config.pooled_projection_dim if transformer is not None else 128
    tokenizer, tokenizer_2 = (
        tiny.clip_tokenizer(scratch / "tokenizer"),
        tiny.clip_tokenizer(scratch / "tokenizer_2", "!"),
    )
    tokenizer_3 = tiny.t5_tokenizer(scratch / "tokenizer_3", T5_MAX_LENGTH)
    t5 = tiny.t5(tokenizer_3, transformer.config.joint_attention_dim if transformer is not None else 160)  # > CLIPs'
    transformer = transformer or SD3Transformer2DModel(
        sample_size=8,
        patch_size=PATCH,
        in_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=t5.config.d_model,
        caption_projection_dim=32,  # the blocks' width: heads x head dim
        pooled_projection_dim=pooled,
        out_channels=16,
        pos_embed_max_size=32,
        dual_attention_layers=(0,),  # like SD3.5 Medium's first blocks
        qk_norm="rms_norm",
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae or tiny.vae(16, 1.5305, shift_factor=0.0609),
        text_encoder=tiny.clip(tokenizer, pooled * 3 // 8, projection=True),
        text_encoder_2=tiny.clip(tokenizer_2, pooled - pooled * 3 // 8, projection=True),
        text_encoder_3=t5,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
        image_encoder=None,
        feature_extractor=None,
    )
