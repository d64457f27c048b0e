"""The SD family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from transformers import CLIPTextModel, CLIPTokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import family_of
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
from stk.models.layouts import prefixed

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = ["ATTENTION_TARGETS", "KOHYA_UNET", "SD_BETAS", "SPEC", "SDEncoders", "call_unet"]

ATTENTION_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora(_sdxl).py
# kohya's names for a UNet's layers: `lora_unet_` and diffusers' name with `_` for `.`, as kohya's SD scripts write them
# and ComfyUI and diffusers (`_convert_non_diffusers_lora_to_diffusers`) read them for SD and SDXL alike
KOHYA_UNET = prefixed("lora_unet_", dots=False)
SD_BETAS: dict[str, Any] = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


class SDEncoders(Encoders):
    family = family_of(__name__)
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


SPEC = FamilySpec(
    name=family_of(__name__),
    title="SD",
    pipelines=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
    pipeline_class=StableDiffusionPipeline,
    published={"sd15": "SD 1.5 UNet"},  # runwayml/stable-diffusion-v1-5
    text=TextSpec(
        encoders=SDEncoders,
        sequences={"prompt_embeds": "cross_attention_dim"},
    ),
    latents=LatentSpec(),
    denoiser=DenoiserSpec(
        subfolder="unet",
        model_class=UNet2DConditionModel,
        flow=False,
        denoise=_denoise,
        lora_targets=ATTENTION_TARGETS,
        example=Example("examples/text_to_image/train_text_to_image.py"),
    ),
    sampling=SamplingSpec(steps=30, guidance=7.5, negative_prompt=True),
    tiny=TinySpec(text={"prompt_embeds": (77, 32)}, latent_channels=4, pipeline_latents=(1, 4, 8, 8)),
    export=ExportSpec(
        kohya_lora=KOHYA_UNET,
        # SD 1.x's LDM checkpoint (its OpenAI CLIP under transformers' names); SD 2.x's OpenCLIP layout is not written
        single_file=lambda folder: ldm_checkpoint(folder, {"text_encoder": "cond_stage_model.transformer."}, {}),
        single_file_class="StableDiffusionPipeline",
    ),
)
