"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_chroma import ChromaTransformer2DModel

from stk.models import tinyparts as tiny
from stk.models.families.flux import T5_MAX_LENGTH
from stk.models.families.flux.tiny import TINY_BLOCKS

__all__ = ["build"]


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.t5_tokenizer(scratch / "tokenizer", T5_MAX_LENGTH)
    t5 = tiny.t5(tokenizer, transformer.config.joint_attention_dim if transformer is not None else 48)
    transformer = transformer or ChromaTransformer2DModel(
        **TINY_BLOCKS,
        joint_attention_dim=t5.config.d_model,
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae or tiny.vae(16, 0.3611, shift_factor=0.1159),  # FLUX.1's VAE
        text_encoder=t5,
        tokenizer=tokenizer,
        transformer=transformer,
    )
