"""SDXL: two CLIP text encoders. Their penultimate hidden states, concatenated, condition the UNet; the second
one's projected text embedding is the pooled vector (diffusers' StableDiffusionXLPipeline.encode_prompt)."""

from __future__ import annotations

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.detect import Family

__all__ = ["SDXLEncoders"]


class SDXLEncoders(Encoders):
    family = Family.SDXL
    text_outputs = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> SDXLEncoders:
        clip = load_text_encoder(model, "", CLIPTokenizer, CLIPTextModel, device, dtype)
        clip_2 = load_text_encoder(model, "_2", CLIPTokenizer, CLIPTextModelWithProjection, device, dtype)
        return cls(model, load_vae(model, device, dtype), (clip, clip_2))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        clip, clip_2 = self.text
        ids, mask = clip.tokenize(captions)
        hidden = clip.model(ids, output_hidden_states=True).hidden_states
        ids_2, mask_2 = clip_2.tokenize(captions)
        output_2 = clip_2.model(ids_2, output_hidden_states=True)
        outputs = {
            "prompt_embeds": torch.cat([hidden[-2], output_2.hidden_states[-2]], dim=-1),
            "pooled_prompt_embeds": output_2.text_embeds,
        }
        return outputs, torch.maximum(mask.sum(dim=1), mask_2.sum(dim=1))
