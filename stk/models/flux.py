"""Flux: T5's last hidden state conditions the transformer and CLIP's pooled output is the pooled vector
(diffusers' FluxPipeline.encode_prompt)."""

from __future__ import annotations

import torch
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.detect import Family

__all__ = ["T5_MAX_LENGTH", "FluxEncoders"]

T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length (dev); capped by the tokenizer's own limit


class FluxEncoders(Encoders):
    family = Family.FLUX
    text_outputs = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> FluxEncoders:
        clip = load_text_encoder(model, "", CLIPTokenizer, CLIPTextModel, device, dtype)
        t5 = load_text_encoder(model, "_2", T5Tokenizer, T5EncoderModel, device, dtype, max_length=T5_MAX_LENGTH)
        return cls(model, load_vae(model, device, dtype), (clip, t5))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        clip, t5 = self.text
        ids, _ = clip.tokenize(captions)
        pooled = clip.model(ids).pooler_output
        ids_2, mask_2 = t5.tokenize(captions)
        embeds = t5.model(ids_2).last_hidden_state
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}, mask_2.sum(dim=1)
