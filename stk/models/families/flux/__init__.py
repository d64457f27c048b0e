"""The Flux family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import family_of
from stk.models.families.sd import ATTENTION_TARGETS
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
from stk.models.layouts import Blocks, Fuse, block_layout

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = [
    "KOHYA_LORA",
    "LORA_TARGETS",
    "PATCH",
    "SPEC",
    "T5_MAX_LENGTH",
    "FluxEncoders",
    "pack_latents",
    "position_ids",
]

T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length (dev); capped by the tokenizer's own limit
PATCH = 2  # FluxPipeline._pack_latents packs 2x2 latent patches into one token

# diffusers' train_dreambooth_lora_flux.py: the attention projections of both streams (the single blocks'
# `attn.to_q/k/v` match too) and the double blocks' feed-forwards. Not `proj_out`: the name ends the single blocks' MLP
# and also names the transformer's last projection, which diffusers leaves alone; `--lora-targets` adds `proj_mlp` or
# `proj_out` on request.
LORA_TARGETS = (
    *(f"attn.{name}" for name in ATTENTION_TARGETS),
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)

# FLUX.1's own layer names (black-forest-labs/flux) under `diffusion_model.`, as ComfyUI loads a FLUX LoRA and
# diffusers' `_convert_kohya_flux_lora_to_diffusers` reads it back; q, k and v are one `qkv` layer there, and the single
# blocks' q, k, v and MLP one `linear1` (the MLP 4x as wide: FluxSingleTransformerBlock's mlp_ratio). Chroma's blocks
# are these without the modulation layers.
KOHYA_LORA = block_layout(
    (
        Blocks(
            "transformer_blocks.",
            "double_blocks.",
            renames=(
                ("attn.to_out.0", "img_attn.proj"),
                ("attn.to_add_out", "txt_attn.proj"),
                ("ff.net.0.proj", "img_mlp.0"),
                ("ff.net.2", "img_mlp.2"),
                ("ff_context.net.0.proj", "txt_mlp.0"),
                ("ff_context.net.2", "txt_mlp.2"),
                ("norm1.linear", "img_mod.lin"),
                ("norm1_context.linear", "txt_mod.lin"),
            ),
            fusions=(
                Fuse("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                Fuse("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
            ),
        ),
        Blocks(
            "single_transformer_blocks.",
            "single_blocks.",
            renames=(("proj_out", "linear2"), ("norm.linear", "modulation.lin")),
            fusions=(Fuse("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), units=(1, 1, 1, 4)),),
        ),
    ),
    top=(("x_embedder", "img_in"), ("context_embedder", "txt_in"), ("proj_out", "final_layer.linear")),
)


# the benchmarks' block counts: config key -> the transformer's list of those blocks
BLOCK_COUNTS = {"num_layers": "transformer_blocks", "num_single_layers": "single_transformer_blocks"}


class FluxEncoders(Encoders):
    family = family_of(__name__)
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


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C), FluxPipeline's token layout."""
    b, c, h, w = latents.shape
    packed: torch.Tensor = FluxPipeline._pack_latents(latents, b, c, h, w)
    return packed


def position_ids(prompt_embeds: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(txt_ids, img_ids) of FluxPipeline for a text sequence and (B, C, h, w) latents: zeros for the text, each
    packed patch's row and column for the image."""
    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype)
    return txt_ids, FluxPipeline._prepare_latent_image_ids(b, h // PATCH, w // PATCH, device, dtype)


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The packed prediction, with the ids and guidance FluxPipeline gives the transformer."""
    b, device = noisy.shape[0], noisy.device
    module: Any = getattr(denoiser, "module", denoiser)  # a DeepSpeed engine holds the model as .module
    guidance = torch.full((b,), objective.guidance_scale, device=device) if module.config.guidance_embeds else None
    prompt_embeds = inputs.text["prompt_embeds"]
    txt_ids, img_ids = position_ids(prompt_embeds, noisy)
    prediction: torch.Tensor = denoiser(
        hidden_states=pack_latents(noisy),
        timestep=sigmas,  # FluxPipeline passes timestep / 1000 with timestep = sigma * 1000
        guidance=guidance,
        pooled_projections=inputs.text["pooled_prompt_embeds"],
        encoder_hidden_states=prompt_embeds,
        txt_ids=txt_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]
    return prediction


SPEC = FamilySpec(
    name=family_of(__name__),
    title="Flux",
    pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
    pipeline_class=FluxPipeline,
    published={"flux-dev": "Flux.1-dev"},  # black-forest-labs/FLUX.1-dev
    text=TextSpec(
        encoders=FluxEncoders,
        sequences={"prompt_embeds": "joint_attention_dim"},
        pooled={"pooled_prompt_embeds": "pooled_projection_dim"},
        tokens=T5_MAX_LENGTH,
    ),
    latents=LatentSpec(
        patch_size=PATCH,
        pack=pack_latents,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=FluxTransformer2DModel,
        flow=True,
        denoise=_denoise,
        lora_targets=LORA_TARGETS,
        example=Example("examples/dreambooth/train_dreambooth_flux.py"),
        blocks=BLOCK_COUNTS,
    ),
    # the guidance embedding of FLUX.1-dev, not classifier-free guidance: no negative prompt
    sampling=SamplingSpec(steps=28, guidance=3.5, negative_prompt=False),
    tiny=TinySpec(
        text={"prompt_embeds": (16, 48), "pooled_prompt_embeds": (32,)},
        latent_channels=16,
        pipeline_latents=(1, 16, 64),
    ),
    export=ExportSpec(
        kohya_lora=KOHYA_LORA,
    ),
)
