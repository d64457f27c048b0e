"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from stk.models import tinyparts as tiny
from stk.models.families.qwenimage import PATCH, PROMPT_TEMPLATE, SCHEDULER

__all__ = ["build"]


def _text_encoder(tokenizer: Any, width: int) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL two layers deep, its text model `width` wide (the transformer's joint_attention_dim); the vision
    tower, which text encoding never runs, one small block."""
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},  # half of head width 8
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    # the template's words are single tokens, as in Qwen's vocabulary: the 34 dropped tokens are the same ones
    words = re.findall(r"[A-Za-z]+", re.sub(r"<\|\w+\|>", "", PROMPT_TEMPLATE))
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer", tiny.merge_order((*words, *tiny.WORDS)))
    transformer = transformer or QwenImageTransformer2DModel(
        patch_size=PATCH,
        in_channels=4 * 16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae or AutoencoderKLQwenImage(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),  # Qwen-Image's stats
        text_encoder=_text_encoder(tokenizer, transformer.config.joint_attention_dim),
        tokenizer=tokenizer,
        transformer=transformer,
    )
