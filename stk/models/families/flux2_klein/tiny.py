"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen3Config, Qwen3ForCausalLM

from stk.models import tinyparts as tiny
from stk.models.families import flux2
from stk.models.families.flux2.tiny import tiny_pipeline, tiny_text_width
from stk.models.families.flux2_klein import HIDDEN_STATES_LAYERS

__all__ = ["build"]


def build(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer")
    qwen = Qwen3ForCausalLM(  # as the hub ships it; deep enough for the pipeline's layer 27
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=tiny_text_width(transformer),
            intermediate_size=32,
            num_hidden_layers=max(HIDDEN_STATES_LAYERS) + 1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=flux2.MAX_SEQUENCE_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
    )
    return tiny_pipeline(qwen, tokenizer, transformer, vae, guidance_embeds=False)
