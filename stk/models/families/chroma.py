"""Chroma (lodestones' Chroma1): FLUX.1-schnell's transformer with its modulation layers replaced by one small
approximator (`distilled_guidance_layer`), conditioned on T5 alone: no CLIP, no pooled vector, no guidance input;
sampled with true classifier-free guidance and a negative prompt.

diffusers has no training example for Chroma: it trains by FLUX.1's recipe (diffusers' train_dreambooth_flux.py and
train_dreambooth_lora_flux.py, as stk.models.families.flux does, their defaults included: rectified flow, target noise -
latents, 2x2 latent patches packed into tokens, the same packing and position ids) with ChromaPipeline's scheduler, and
the transformer is called as ChromaPipeline.__call__ calls it: timestep = sigma (the pipeline passes timestep / 1000
with timestep = sigma * 1000), zero txt_ids, the packed patches' img_ids, and the attention mask of
ChromaPipeline._prepare_attention_mask: the text mask joined with ones for the image tokens.

Text is ChromaPipeline._get_t5_prompt_embeds: T5 run with the tokenizer's attention mask over 512 tokens, after which
the transformer attends to each caption's real tokens and ONE padding token (`mask_indices <= seq_lengths`). The cache
stores exactly those (TEXT_MASK, stk.models.textmask). Two choices where diffusers 0.42 differs from the model's own
training code (lodestone-rock/flow), both needed only when captions of different lengths share a batch:
- the mask is boolean. The pipeline's own is float 0/1, which attention adds to the scores instead of masking
  (diffusers issues 12116, 13619). A cached caption holds no padding but the one kept token, so for one caption both
  readings agree; the zeros that pad shorter captions in a batch are masked only by a boolean mask. Their rows are
  then fully masked: no NaN forward or backward on the CPU (torch 2.13) nor on an H200 (torch 2.11, bf16, each of
  SDPA's efficient, cuDNN and math kernels), and a padded caption's image tokens match its unpadded ones within bf16
  rounding (measured).
- under gradient checkpointing ChromaTransformer2DModel gives its single-stream blocks no mask (the checkpointed call
  drops it); `_MaskedCheckpoint` hands it on, so a checkpointed step is the same step as one without.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock, ChromaTransformer2DModel
from diffusers.pipelines.chroma.pipeline_chroma import ChromaPipeline
from transformers import T5EncoderModel, T5Tokenizer

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.flux import (
    KOHYA_LORA,
    LORA_TARGETS,
    PATCH,
    T5_MAX_LENGTH,
    TINY_BLOCKS,
    pack_latents,
    position_ids,
)
from stk.models.families.registry import Family
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.textmask import TEXT_MASK, masked_sample_inputs, text_mask

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

__all__ = ["SPEC", "ChromaEncoders"]


class ChromaEncoders(Encoders):
    family = Family.CHROMA
    text_outputs = ("prompt_embeds", TEXT_MASK)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> ChromaEncoders:
        t5 = load_text_encoder(model, "", T5Tokenizer, T5EncoderModel, device, dtype, max_length=T5_MAX_LENGTH)
        return cls(model, load_vae(model, device, dtype), (t5,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (t5,) = self.text
        ids, mask = t5.tokenize(captions)
        embeds = t5.model(ids, attention_mask=mask).last_hidden_state
        # ChromaPipeline._get_t5_prompt_embeds: the real tokens and the first padding token
        kept = torch.arange(mask.shape[1], device=mask.device)[None] <= mask.sum(dim=1, keepdim=True)
        return {"prompt_embeds": embeds, TEXT_MASK: kept[..., None].to(embeds.dtype)}, kept.sum(dim=1)


class _MaskedCheckpoint:
    """The transformer's gradient checkpointing function, handing the single-stream blocks the attention mask that
    ChromaTransformer2DModel's checkpointed call leaves out. `mask` is set for the length of one forward call; the
    checkpoint keeps it among its inputs for the recomputation in the backward pass."""

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        self.checkpoint = checkpoint
        self.mask: torch.Tensor | None = None

    def __call__(self, block: torch.nn.Module, *args: Any) -> Any:
        if isinstance(block, ChromaSingleTransformerBlock) and self.mask is not None:
            return self.checkpoint(block, *args, self.mask)  # (hidden_states, temb, image_rotary_emb, attention_mask)
        return self.checkpoint(block, *args)


def _masked_checkpoint(module: Any) -> _MaskedCheckpoint | None:
    """The module's checkpointing function, made a _MaskedCheckpoint once; None when it does not checkpoint."""
    if not getattr(module, "gradient_checkpointing", False):
        return None
    if not isinstance(module._gradient_checkpointing_func, _MaskedCheckpoint):
        module._gradient_checkpointing_func = _MaskedCheckpoint(module._gradient_checkpointing_func)
    checkpoint: _MaskedCheckpoint = module._gradient_checkpointing_func
    return checkpoint


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The packed prediction, with the ids and attention mask ChromaPipeline gives the transformer."""
    prompt_embeds = inputs.text["prompt_embeds"]
    hidden_states = pack_latents(noisy)
    txt_ids, img_ids = position_ids(prompt_embeds, noisy)
    image = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=noisy.device)
    mask = torch.cat([text_mask(inputs.text), image], dim=1)  # ChromaPipeline._prepare_attention_mask
    checkpoint = _masked_checkpoint(getattr(denoiser, "module", denoiser))  # a DeepSpeed engine holds it as .module
    if checkpoint is not None:
        checkpoint.mask = mask
    try:
        prediction: torch.Tensor = denoiser(
            hidden_states=hidden_states,
            timestep=sigmas,  # ChromaPipeline passes timestep / 1000 with timestep = sigma * 1000
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            attention_mask=mask,
            return_dict=False,
        )[0]
    finally:
        if checkpoint is not None:
            checkpoint.mask = None
    return prediction


def _sample_inputs(embeddings: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ChromaPipeline takes each prompt's attention mask beside its embeddings (boolean: see the module's note)."""
    return masked_sample_inputs(embeddings, "prompt_attention_mask")


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.t5_tokenizer(scratch / "tokenizer", T5_MAX_LENGTH)
    t5 = tiny.t5(tokenizer, transformer.config.joint_attention_dim if transformer is not None else 48)
    transformer = transformer or ChromaTransformer2DModel(
        **TINY_BLOCKS,
        joint_attention_dim=t5.config.d_model,
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae or tiny.vae(16, 0.3611, shift_factor=0.1159),  # FLUX.1's VAE
        text_encoder=t5,
        tokenizer=tokenizer,
        transformer=transformer,
    )


SPEC = FamilySpec(
    name=Family.CHROMA,
    title="Chroma",
    pipelines=("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline"),
    pipeline_class=ChromaPipeline,
    encoders=ChromaEncoders,
    denoiser_subfolder="transformer",
    denoiser_class=ChromaTransformer2DModel,
    flow=True,
    denoise=_denoise,
    # FLUX.1's (diffusers' train_dreambooth_lora_flux.py): Chroma's blocks are Flux's without the modulation layers
    lora_targets=LORA_TARGETS,
    # ChromaPipeline.__call__'s defaults; classifier-free guidance with the empty caption as the negative prompt
    sampling=Sampling(steps=35, guidance=5.0, negative_prompt=True),
    example=Example("examples/dreambooth/train_dreambooth_flux.py"),  # FLUX.1's recipe: Chroma has no diffusers example
    published=("chroma1",),  # lodestones/Chroma1-HD
    tiny=_tiny,
    patch_size=PATCH,
    pack=pack_latents,
    sample_inputs=_sample_inputs,
    kohya_lora=KOHYA_LORA,  # FLUX.1's names; ChromaPipeline reads them through FLUX.1's converter
)
