"""The text mask of a family whose pipeline masks padded tokens (Chroma, Z-Image, Qwen-Image): the one home of its
convention.

Such a family lists TEXT_MASK among its text outputs: a (L, 1) sequence of ones over the real tokens, stored with
them (stk.models.base.Encoders keeps only those). Batched, it is zero-padded like the embeddings are (the cache's
collate, caption dropout, a sample image's negative prompt), so it stays the attention mask of whatever it is batched
with, and nothing outside the family has to know it is there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TEXT_MASK", "masked_prompts", "masked_sample_inputs", "text_mask"]

TEXT_MASK = "text_mask"


def text_mask(text: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L) bool attention mask of a batch's text sequences, from its TEXT_MASK."""
    return text[TEXT_MASK][..., 0] > 0.5


def masked_prompts(embeddings: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """For a sample image's embeddings (the prompt's, and the negative prompt's prefixed `negative_` when there is
    one): each one's prefix, its (B, L, D) prompt_embeds and their (B, L) bool mask."""
    for prefix in ("", "negative_"):
        if f"{prefix}prompt_embeds" in embeddings:
            mask = text_mask({TEXT_MASK: embeddings[f"{prefix}{TEXT_MASK}"]})
            yield prefix, embeddings[f"{prefix}prompt_embeds"], mask


def masked_sample_inputs(embeddings: dict[str, torch.Tensor], mask_argument: str) -> dict[str, Any]:
    """A sample image's embeddings (the prompt's, and the negative prompt's prefixed `negative_`) as a pipeline takes
    them with each one's (B, L) bool mask beside it, under `mask_argument` (the negative's prefixed alike)."""
    out: dict[str, Any] = {}
    for prefix, embeds, mask in masked_prompts(embeddings):
        out[f"{prefix}prompt_embeds"], out[prefix + mask_argument] = embeds, mask
    return out
