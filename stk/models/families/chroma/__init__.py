"""The Chroma family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock, ChromaTransformer2DModel
from diffusers.pipelines.chroma.pipeline_chroma import ChromaPipeline
from transformers import T5EncoderModel, T5Tokenizer

from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.flux import (
    BLOCK_COUNTS,
    KOHYA_LORA,
    LORA_TARGETS,
    PATCH,
    T5_MAX_LENGTH,
    pack_latents,
    position_ids,
)
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
from stk.models.textmask import TEXT_MASK, masked_sample_inputs, text_mask

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = ["SPEC", "ChromaEncoders"]


class ChromaEncoders(Encoders):
    family = family_of(__name__)
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


SPEC = FamilySpec(
    name=family_of(__name__),
    title="Chroma",
    pipelines=("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline"),
    pipeline_class=ChromaPipeline,
    published={"chroma1": "Chroma1"},  # lodestones/Chroma1-HD
    text=TextSpec(
        encoders=ChromaEncoders,
        sequences={"prompt_embeds": "joint_attention_dim", TEXT_MASK: 1},
        tokens=T5_MAX_LENGTH,
    ),
    latents=LatentSpec(
        patch_size=PATCH,
        pack=pack_latents,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=ChromaTransformer2DModel,
        flow=True,
        denoise=_denoise,
        # FLUX.1's (diffusers' train_dreambooth_lora_flux.py): Chroma's blocks are Flux's without the modulation layers
        lora_targets=LORA_TARGETS,
        example=Example(
            "examples/dreambooth/train_dreambooth_flux.py"
        ),  # FLUX.1's recipe: Chroma has no diffusers example
        blocks=BLOCK_COUNTS,
    ),
    # ChromaPipeline.__call__'s defaults; classifier-free guidance with the empty caption as the negative prompt
    sampling=SamplingSpec(
        steps=35,
        guidance=5.0,
        negative_prompt=True,
        inputs=_sample_inputs,
    ),
    tiny=TinySpec(
        text={"prompt_embeds": (16, 48), TEXT_MASK: (16, 1)}, latent_channels=16, pipeline_latents=(1, 16, 64)
    ),
    export=ExportSpec(
        kohya_lora=KOHYA_LORA,  # FLUX.1's names; ChromaPipeline reads them through FLUX.1's converter
    ),
)
