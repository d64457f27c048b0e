"""Captions as the Qwen3-conditioned pipelines hand them to their text encoder: each one the user's turn of a chat,
rendered by the tokenizer's chat template with the assistant's turn opened (ZImagePipeline with thinking enabled,
Flux2KleinPipeline with it disabled, which appends an empty thinking block)."""

from __future__ import annotations

from typing import Any

__all__ = ["chat_prompts"]


def chat_prompts(tokenizer: Any, captions: list[str], thinking: bool) -> list[str]:
    """Each caption as the text the pipeline tokenizes."""
    return [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": caption}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=thinking,
            )
        )
        for caption in captions
    ]
