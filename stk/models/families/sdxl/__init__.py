"""The SDXL family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import family_of
from stk.models.families.sd import ATTENTION_TARGETS, KOHYA_UNET, call_unet
from stk.models.families.sd.ldm import ldm_checkpoint
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

__all__ = ["SPEC", "SDXLEncoders"]


class SDXLEncoders(Encoders):
    family = family_of(__name__)
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


def _denoise(
    objective: DenoiseSettings,
    denoiser: torch.nn.Module,
    noisy: torch.Tensor,
    timesteps: torch.Tensor,
    inputs: StepInputs,
) -> torch.Tensor:
    """Time ids per sample: original (h, w), crop (top, left), target (h, w), the order of
    StableDiffusionXLPipeline._get_add_time_ids; the target is the size the latents decode to."""
    latents = inputs.latents
    device, (b, _, h, w) = latents.device, latents.shape
    target = torch.tensor([[h, w]], device=device).expand(b, 2) * objective.vae_scale_factor
    time_ids = torch.cat([inputs.original_size.to(device), inputs.crop_top_left.to(device), target], dim=1)
    added = {"text_embeds": inputs.text["pooled_prompt_embeds"], "time_ids": time_ids.to(latents.dtype)}
    prediction: torch.Tensor = call_unet(
        denoiser, noisy, timesteps, encoder_hidden_states=inputs.text["prompt_embeds"], added_cond_kwargs=added
    )
    return prediction


SPEC = FamilySpec(
    name=family_of(__name__),
    title="SDXL",
    pipelines=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline"),
    pipeline_class=StableDiffusionXLPipeline,
    published={"sdxl": "SDXL UNet"},  # stabilityai/stable-diffusion-xl-base-1.0
    text=TextSpec(
        encoders=SDXLEncoders,
        sequences={"prompt_embeds": "cross_attention_dim"},
        pooled={"pooled_prompt_embeds": 1280},
    ),
    latents=LatentSpec(),
    denoiser=DenoiserSpec(
        subfolder="unet",
        model_class=UNet2DConditionModel,
        flow=False,
        denoise=_denoise,
        lora_targets=ATTENTION_TARGETS,
        example=Example("examples/text_to_image/train_text_to_image_sdxl.py"),
    ),
    sampling=SamplingSpec(steps=30, guidance=5.0, negative_prompt=True),
    tiny=TinySpec(
        text={"prompt_embeds": (77, 96), "pooled_prompt_embeds": (64,)},
        latent_channels=4,
        pipeline_latents=(1, 4, 8, 8),
    ),
    export=ExportSpec(
        kohya_lora=KOHYA_UNET,
        single_file=lambda folder: ldm_checkpoint(
            folder,
            {"text_encoder": "conditioner.embedders.0.transformer."},
            {"text_encoder_2": "conditioner.embedders.1.model."},
        ),
        single_file_class="StableDiffusionXLPipeline",
    ),
)
