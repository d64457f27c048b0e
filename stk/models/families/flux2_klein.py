"""FLUX.2-klein (4B and 9B, base and distilled): FLUX.2's transformer and VAE (stk.models.families.flux2) conditioned
on Qwen3, trained as diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py trains it.

- Text (Flux2KleinPipeline._get_qwen3_prompt_embeds): each caption in Qwen3's chat template (a user turn, then the
  assistant's, thinking disabled), padded to 512 tokens; the hidden states of layers 9, 18 and 27 under the attention
  mask, side by side (3 x the encoder's width). The pipeline hands the transformer all 512 positions, padding
  included, so the cache stores them all. (The example's `--text_encoder_out_layers` defaults to FLUX.2-dev's
  10, 20, 30; stk follows the pipeline that makes the images, as the example's validation does not.)
  The text encoder loads as Qwen3Model: the hub's Qwen3ForCausalLM without its unused language-model head.
- No guidance input (`guidance_embeds` false); samples use classifier-free guidance with the empty caption.
- Sigmas and latents: FLUX.2-dev's (stk.models.families.flux2).
- Samples: the pipeline's defaults, 50 steps at guidance 4 (the base models; the distilled FLUX.2-klein-4B/9B sample
  in 4 steps at guidance 1: pass --validation-steps and --validation-guidance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from stk.models import tinyparts as tiny
from stk.models.chat import chat_prompts
from stk.models.components import load_text_encoder, load_vae
from stk.models.families import flux2
from stk.models.families.registry import Family
from stk.models.families.spec import Example, FamilySpec, Sampling

__all__ = ["HIDDEN_STATES_LAYERS", "SPEC", "Flux2KleinEncoders"]

HIDDEN_STATES_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


class Flux2KleinEncoders(flux2.Flux2Encoders):
    family = Family.FLUX2_KLEIN
    text_outputs = ("prompt_embeds",)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> Flux2KleinEncoders:
        qwen = load_text_encoder(
            model, "", Qwen2Tokenizer, Qwen3Model, device, dtype, max_length=flux2.MAX_SEQUENCE_LENGTH
        )
        return cls(model, load_vae(model, device, dtype, flux2.VAE_CLASS), (qwen,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (qwen,) = self.text
        ids, mask = qwen.tokenize(chat_prompts(qwen.tokenizer, captions, thinking=False))
        hidden = qwen.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        embeds = flux2.stacked_hidden_states(hidden.hidden_states, HIDDEN_STATES_LAYERS)
        return {"prompt_embeds": embeds}, mask.sum(dim=1)


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer")
    qwen = Qwen3ForCausalLM(  # as the hub ships it; deep enough for the pipeline's layer 27
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=flux2.tiny_text_width(transformer),
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
    return flux2.tiny_pipeline(qwen, tokenizer, transformer, vae, guidance_embeds=False)


SPEC = FamilySpec(
    name=Family.FLUX2_KLEIN,
    title="FLUX.2-klein",
    pipelines=("Flux2KleinPipeline", "Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline"),
    pipeline_class=Flux2KleinPipeline,
    encoders=Flux2KleinEncoders,
    denoiser_subfolder="transformer",
    denoiser_class=Flux2Transformer2DModel,
    flow=True,
    denoise=flux2.denoise,
    lora_targets=flux2.LORA_TARGETS,
    sampling=Sampling(steps=50, guidance=4.0, negative_prompt=True),  # Flux2KleinPipeline's defaults (base models)
    example=Example("examples/dreambooth/train_dreambooth_lora_flux2_klein.py", samples_latents=False),
    published=("flux2-klein-4b", "flux2-klein-9b"),  # black-forest-labs/FLUX.2-klein-base-4B and -9B
    tiny=_tiny,
    patch_size=flux2.PATCH,
    pack=flux2.pack,
    vae_class=flux2.VAE_CLASS,
    inference_mu=flux2.empirical_mu,
    kohya_lora=flux2.KOHYA_LORA,
    single_file=flux2.single_file,
    single_file_class="Flux2Transformer2DModel",
    text_encoders_in_train=False,  # its text encoder loads in stk-cache only
)
