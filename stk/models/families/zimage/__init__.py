"""The Z-Image family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Tokenizer, Qwen3Model

from stk.models.base import Encoders
from stk.models.chat import chat_prompts
from stk.models.components import load_text_encoder, load_vae
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
from stk.models.layouts import Blocks, Fuse, block_layout, block_weights, read_component
from stk.models.textmask import TEXT_MASK, masked_prompts, text_mask

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = ["MAX_SEQUENCE_LENGTH", "SPEC", "ZImageEncoders"]

MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's default max_sequence_length
TRAIN_TIMESTEPS = 1000  # the pipeline's timestep scale: t = 1000 sigma, given to the transformer as (1000 - t) / 1000
PATCH = 2  # the transformer's all_patch_size: 2x2 latent patches per token
# Z-Image's own layer names (Tongyi-MAI's, ComfyUI's), the inverse of diffusers' convert_z_image_transformer_
# checkpoint_to_diffusers: q, k and v are one `attention.qkv`, `to_out.0` is `attention.out`; the other layers keep
# their names. A LoRA takes kohya's form of them (`lora_unet_layers_0_attention_qkv`): the one in which diffusers'
# `_convert_non_diffusers_z_image_lora_to_diffusers` splits a fused qkv (a `diffusion_model.` one it keeps fused).
RENAMES = (
    ("attention.to_out.0", "attention.out"),
    ("attention.norm_q", "attention.q_norm"),
    ("attention.norm_k", "attention.k_norm"),
    *((f"feed_forward.{w}", f"feed_forward.{w}") for w in ("w1", "w2", "w3")),
    ("adaLN_modulation.0", "adaLN_modulation.0"),
)
QKV = Fuse("attention.qkv", ("attention.to_q", "attention.to_k", "attention.to_v"))
BLOCKS = tuple(
    Blocks(f"{kind}.", f"{kind}.", RENAMES, (QKV,)) for kind in ("layers", "noise_refiner", "context_refiner")
)
TOP = (("all_x_embedder.2-1", "x_embedder"), ("all_final_layer.2-1", "final_layer"))
KOHYA_LORA = block_layout(BLOCKS, TOP, prefix="lora_unet_", underscores=True)


def single_file(folder: Path) -> dict[str, torch.Tensor]:
    """The transformer of the pipeline in `folder` as Tongyi-MAI's checkpoint names it (ZImageTransformer2DModel
    .from_single_file, ComfyUI's diffusion_models/)."""
    return block_weights(BLOCKS, TOP, read_component(folder / "transformer")[1])


LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")  # the example's default target_modules (no --lora_layers)


class ZImageEncoders(Encoders):
    family = family_of(__name__)
    text_outputs = ("prompt_embeds", TEXT_MASK)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> ZImageEncoders:
        qwen = load_text_encoder(model, "", Qwen2Tokenizer, Qwen3Model, device, dtype, max_length=MAX_SEQUENCE_LENGTH)
        return cls(model, load_vae(model, device, dtype), (qwen,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (qwen,) = self.text
        ids, mask = qwen.tokenize(chat_prompts(qwen.tokenizer, captions, thinking=True))
        mask = mask.bool()
        hidden = qwen.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        # each caption's real tokens, wherever the tokenizer put its padding, first and then zeros
        embeds = pad_sequence([h[m] for h, m in zip(hidden, mask, strict=True)], batch_first=True)
        lengths = mask.sum(dim=1)
        real = torch.arange(embeds.shape[1], device=embeds.device)[None] < lengths[:, None]
        return {"prompt_embeds": embeds, TEXT_MASK: real[..., None].to(embeds.dtype)}, lengths


def _captions(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """(B, L, D) zero-padded embeddings and their (B, L) bool mask -> each caption's (L_i, D) real tokens, the list
    ZImagePipeline gives the transformer."""
    return [e[m] for e, m in zip(embeds, mask, strict=True)]


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The (B, C, h, w) prediction of noise - latents: the transformer's own output negated, as the example does."""
    timesteps = sigmas.float() * TRAIN_TIMESTEPS
    output: list[torch.Tensor] = denoiser(
        list(noisy.unsqueeze(2).unbind(dim=0)),  # (C, 1, h, w) each: one frame
        (TRAIN_TIMESTEPS - timesteps) / TRAIN_TIMESTEPS,
        _captions(inputs.text["prompt_embeds"], text_mask(inputs.text)),
        return_dict=False,
    )[0]
    return -torch.stack(output, dim=0).squeeze(2)


def _sample_inputs(embeddings: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ZImagePipeline takes prompt_embeds and negative_prompt_embeds as lists of each prompt's real tokens."""
    return {f"{prefix}prompt_embeds": _captions(embeds, mask) for prefix, embeds, mask in masked_prompts(embeddings)}


SPEC = FamilySpec(
    name=family_of(__name__),
    title="Z-Image",
    pipelines=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"),
    pipeline_class=ZImagePipeline,
    published={"zimage": "Z-Image"},  # Tongyi-MAI/Z-Image
    text=TextSpec(
        encoders=ZImageEncoders,
        sequences={"prompt_embeds": "cap_feat_dim", TEXT_MASK: 1},
        tokens=128,
    ),
    latents=LatentSpec(
        patch_size=PATCH,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=ZImageTransformer2DModel,
        flow=True,
        denoise=_denoise,
        lora_targets=LORA_TARGETS,
        example=Example("examples/dreambooth/train_dreambooth_lora_z_image.py", samples_latents=False),
        blocks={"n_layers": "layers"},
    ),
    sampling=SamplingSpec(  # Tongyi-MAI/Z-Image's card
        steps=50,
        guidance=4.0,
        negative_prompt=True,
        inputs=_sample_inputs,
    ),
    tiny=TinySpec(
        text={"prompt_embeds": (16, 32), TEXT_MASK: (16, 1)}, latent_channels=16, pipeline_latents=(1, 16, 8, 8)
    ),
    export=ExportSpec(
        kohya_lora=KOHYA_LORA,
        single_file=single_file,
        single_file_class="ZImageTransformer2DModel",
    ),
)
