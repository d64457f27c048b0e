"""The FLUX.2-klein family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from transformers import Qwen2Tokenizer, Qwen3Model

from stk.models.chat import chat_prompts
from stk.models.components import load_text_encoder, load_vae
from stk.models.families import flux2
from stk.models.families.registry import family_of
from stk.models.families.spec import (
    DenoiserSpec,
    Example,
    ExportSpec,
    FamilySpec,
    LatentSpec,
    SamplingSpec,
    TextSpec,
    TinySpec,
)

__all__ = ["HIDDEN_STATES_LAYERS", "SPEC", "Flux2KleinEncoders"]

HIDDEN_STATES_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


class Flux2KleinEncoders(flux2.Flux2Encoders):
    family = family_of(__name__)
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


SPEC = FamilySpec(
    name=family_of(__name__),
    title="FLUX.2-klein",
    pipelines=("Flux2KleinPipeline", "Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline"),
    pipeline_class=Flux2KleinPipeline,
    published={
        "flux2-klein-4b": "FLUX.2-klein 4B",
        "flux2-klein-9b": "FLUX.2-klein 9B",
    },  # black-forest-labs/FLUX.2-klein-base-4B and -9B
    text=TextSpec(
        encoders=Flux2KleinEncoders,
        sequences={"prompt_embeds": "joint_attention_dim"},
        tokens=flux2.MAX_SEQUENCE_LENGTH,
        in_train=False,  # its text encoder loads in stk-cache only
    ),
    latents=LatentSpec(
        vae_class=flux2.VAE_CLASS,
        patch_size=flux2.PATCH,
        pack=flux2.pack,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=Flux2Transformer2DModel,
        flow=True,
        denoise=flux2.denoise,
        lora_targets=flux2.LORA_TARGETS,
        example=Example("examples/dreambooth/train_dreambooth_lora_flux2_klein.py", samples_latents=False),
        inference_mu=flux2.empirical_mu,
        blocks=flux2.BLOCK_COUNTS,
    ),
    sampling=SamplingSpec(steps=50, guidance=4.0, negative_prompt=True),  # Flux2KleinPipeline's defaults (base models)
    tiny=TinySpec(text={"prompt_embeds": (16, 48)}, latent_channels=8, pipeline_latents=(1, 8, 8, 8)),
    export=ExportSpec(
        kohya_lora=flux2.KOHYA_LORA,
        single_file=flux2.single_file,
        single_file_class="Flux2Transformer2DModel",
    ),
)
