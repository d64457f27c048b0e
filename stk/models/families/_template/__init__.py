"""A template, not a family: the registry skips folders whose name starts with `_`. Copy this folder to
stk/models/families/<name>/ (the family's name on the command line, `-` written `_`), fill in each TODO, and the
family is registered; the docs' "Add a family" page walks through it. Nothing outside the folder changes.

What each part of the spec is for is in stk/models/families/spec.py; the other families' folders are worked examples
(zimage/ is the shortest flow family, sd/ the shortest DDPM one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers import DiffusionPipeline, ModelMixin

from stk.models.base import Encoders
from stk.models.families.registry import family_of
from stk.models.families.spec import (
    DenoiserSpec,
    DenoiseSettings,
    Example,
    ExportSpec,
    FamilySpec,
    LatentSpec,
    SamplingSpec,
    TextSpec,
    TinySpec,
)

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = ["SPEC"]


class TemplateEncoders(Encoders):
    """TODO: the VAE and the text recipe of the pipeline's own encode_prompt: the cache stores what this returns, and
    a test compares it with the pipeline's encode_prompt."""

    family = family_of(__name__)
    text_outputs = ("prompt_embeds",)  # TODO: the arrays each caption gives (TEXT_MASK where padding is masked)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> TemplateEncoders:
        raise NotImplementedError("TODO: load_text_encoder(...) per encoder, then cls(model, load_vae(...), encoders)")

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        raise NotImplementedError("TODO: the pipeline's encode_prompt, batched; and each caption's real token count")


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """TODO: the denoiser called as the pipeline calls it, on noisy latents (B, C, h, w) and the step's text."""
    raise NotImplementedError


SPEC = FamilySpec(
    name=family_of(__name__),
    title="Template",  # TODO: how messages and the docs name the family
    pipelines=("TemplatePipeline",),  # TODO: model_index.json `_class_name`s that are this family
    pipeline_class=DiffusionPipeline,  # TODO: the pipeline class (saves the LoRA, makes samples)
    published={"published-name": "Template"},  # TODO: configs/<name>/{denoiser,vae}.json -> how tables name it
    text=TextSpec(
        encoders=TemplateEncoders,
        sequences={"prompt_embeds": "joint_attention_dim"},  # TODO: each sequence's width, as a denoiser config key
        pooled={},  # TODO: each pooled vector's width
        tokens=77,  # TODO: text tokens per sample as the cache holds them
        in_train=True,  # TODO: False where the text encoder is an LLM that only stk-cache loads
    ),
    latents=LatentSpec(patch_size=1),  # TODO: the VAE class, patch size and packing, where not the defaults
    denoiser=DenoiserSpec(
        subfolder="transformer",  # TODO: "unet" or "transformer"
        model_class=ModelMixin,  # TODO: the diffusers denoiser class
        flow=True,  # TODO: flow matching, or DDPM
        denoise=_denoise,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0"),  # TODO: the diffusers example's LoRA targets
        example=Example("examples/dreambooth/TODO.py"),  # TODO: the diffusers example whose defaults stk follows
        blocks={"num_layers": "transformer_blocks"},  # TODO: the benchmarks' block count keys
    ),
    sampling=SamplingSpec(steps=30, guidance=4.0, negative_prompt=True),  # TODO: the model card's sampling
    tiny=TinySpec(text={"prompt_embeds": (16, 32)}, latent_channels=16, pipeline_latents=(1, 16, 8, 8)),  # TODO
    export=ExportSpec(),  # TODO: kohya/ComfyUI LoRA keys and the single file, where other tools read them
)
