"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from stk.models import tinyparts as tiny
from stk.models.families.zimage import MAX_SEQUENCE_LENGTH, PATCH, TRAIN_TIMESTEPS

__all__ = ["build"]


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer")
    width = transformer.config.cap_feat_dim if transformer is not None else 32
    qwen = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=MAX_SEQUENCE_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = transformer or ZImageTransformer2DModel(
        all_patch_size=(PATCH,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=width,
        axes_dims=[4, 6, 6],  # sums to the head width, 16
        axes_lens=[1536, 512, 512],
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=TRAIN_TIMESTEPS, shift=6.0),  # Z-Image's
        vae=vae or tiny.vae(16, 0.3611, shift_factor=0.1159),
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=transformer,
    )
