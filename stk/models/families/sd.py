"""Stable Diffusion 1.x/2.x: a UNet trained by DDPM (epsilon or v prediction), conditioned on one CLIP text encoder's
last hidden state, as in diffusers' StableDiffusionPipeline.encode_prompt (no clip_skip) and train_text_to_image.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import PNDMScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from transformers import CLIPTextModel, CLIPTokenizer

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.ldm import ldm_checkpoint
from stk.models.families.registry import Family
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.layouts import prefixed

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

__all__ = ["ATTENTION_TARGETS", "KOHYA_UNET", "SD_BETAS", "SPEC", "SDEncoders", "call_unet"]

ATTENTION_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora(_sdxl).py
# kohya's names for a UNet's layers: `lora_unet_` and diffusers' name with `_` for `.`, as kohya's SD scripts write them
# and ComfyUI and diffusers (`_convert_non_diffusers_lora_to_diffusers`) read them for SD and SDXL alike
KOHYA_UNET = prefixed("lora_unet_", dots=False)
SD_BETAS: dict[str, Any] = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


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


def call_unet(denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, **conditioning: Any) -> Any:
    """The UNet's prediction, called as the pipelines call it: positional latents and timesteps, keyword
    conditioning."""
    return denoiser(noisy, timesteps, **conditioning, return_dict=False)[0]


def _denoise(
    objective: DenoiseSettings,
    denoiser: torch.nn.Module,
    noisy: torch.Tensor,
    timesteps: torch.Tensor,
    inputs: StepInputs,
) -> torch.Tensor:
    prediction: torch.Tensor = call_unet(denoiser, noisy, timesteps, encoder_hidden_states=inputs.text["prompt_embeds"])
    return prediction


def _tiny(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.clip_tokenizer(scratch / "tokenizer")
    width = unet.config.cross_attention_dim if unet is not None else 32
    return dict(
        vae=vae or tiny.vae(4, 0.18215),
        text_encoder=tiny.clip(tokenizer, width),
        tokenizer=tokenizer,
        unet=unet or tiny.unet(width),
        scheduler=PNDMScheduler(**SD_BETAS, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


SPEC = FamilySpec(
    name=Family.SD,
    title="SD",
    pipelines=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
    pipeline_class=StableDiffusionPipeline,
    encoders=SDEncoders,
    denoiser_subfolder="unet",
    denoiser_class=UNet2DConditionModel,
    flow=False,
    denoise=_denoise,
    lora_targets=ATTENTION_TARGETS,
    sampling=Sampling(steps=30, guidance=7.5, negative_prompt=True),
    example=Example("examples/text_to_image/train_text_to_image.py"),
    published=("sd15",),  # runwayml/stable-diffusion-v1-5
    tiny=_tiny,
    kohya_lora=KOHYA_UNET,
    # SD 1.x's LDM checkpoint (its OpenAI CLIP under transformers' names); SD 2.x's OpenCLIP layout is not written
    single_file=lambda folder: ldm_checkpoint(folder, {"text_encoder": "cond_stage_model.transformer."}, {}),
    single_file_class="StableDiffusionPipeline",
)
