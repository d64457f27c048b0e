"""SDXL: a UNet trained by DDPM like SD's, conditioned on two CLIP text encoders (their penultimate hidden states
side by side, the second one's projected text embedding as the pooled vector: diffusers'
StableDiffusionXLPipeline.encode_prompt) and on the image's size and crop ("time ids")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import EulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.ldm import ldm_checkpoint
from stk.models.families.registry import Family
from stk.models.families.sd import ATTENTION_TARGETS, KOHYA_UNET, SD_BETAS, call_unet
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

__all__ = ["SPEC", "SDXLEncoders"]


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


def _tiny(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    # Unequal widths (32 + 64) so a swapped or missing encoder shows in the shapes; tokenizer_2 pads with "!" as
    # SDXL's does, so lengths must come from the attention mask.
    tokenizer, tokenizer_2 = (
        tiny.clip_tokenizer(scratch / "tokenizer"),
        tiny.clip_tokenizer(scratch / "tokenizer_2", "!"),
    )
    time_embed_dim = 8
    unet = unet or tiny.unet(
        32 + 64,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + 64,  # 6 size/crop numbers + pooled
        use_linear_projection=True,
    )
    # the UNet reads both encoders' hidden states side by side, and the second one's pooled output
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
    return dict(
        vae=vae or tiny.vae(4, 0.13025),
        text_encoder=tiny.clip(tokenizer, unet.config.cross_attention_dim - pooled),
        text_encoder_2=tiny.clip(tokenizer_2, pooled, projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading", steps_offset=1),
        add_watermarker=False,
    )


SPEC = FamilySpec(
    name=Family.SDXL,
    title="SDXL",
    pipelines=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline"),
    pipeline_class=StableDiffusionXLPipeline,
    encoders=SDXLEncoders,
    denoiser_subfolder="unet",
    denoiser_class=UNet2DConditionModel,
    flow=False,
    denoise=_denoise,
    lora_targets=ATTENTION_TARGETS,
    sampling=Sampling(steps=30, guidance=5.0, negative_prompt=True),
    example=Example("examples/text_to_image/train_text_to_image_sdxl.py"),
    published=("sdxl",),  # stabilityai/stable-diffusion-xl-base-1.0
    tiny=_tiny,
    kohya_lora=KOHYA_UNET,
    single_file=lambda folder: ldm_checkpoint(
        folder,
        {"text_encoder": "conditioner.embedders.0.transformer."},
        {"text_encoder_2": "conditioner.embedders.1.model."},
    ),
    single_file_class="StableDiffusionXLPipeline",
)
