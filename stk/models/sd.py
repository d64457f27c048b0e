"""Stable Diffusion 1.x/2.x: one CLIP text encoder whose last hidden state conditions the UNet, as in diffusers'
StableDiffusionPipeline.encode_prompt (no clip_skip)."""

from __future__ import annotations

import torch
from transformers import CLIPTextModel, CLIPTokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.detect import Family

__all__ = ["SDEncoders"]


class SDEncoders(Encoders):
    family = Family.SD
    text_outputs = ("prompt_embeds",)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> SDEncoders:
        clip = load_text_encoder(model, "", CLIPTokenizer, CLIPTextModel, device, dtype)
        return cls(model, load_vae(model, device, dtype), (clip,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (clip,) = self.text
        ids, mask = clip.tokenize(captions)
        # Some SD 2.x-era encoders are configured to take the mask; the pipeline passes it only then.
        use_mask = getattr(clip.model.config, "use_attention_mask", False)
        output = clip.model(ids, attention_mask=mask if use_mask else None)
        return {"prompt_embeds": output.last_hidden_state}, mask.sum(dim=1)
