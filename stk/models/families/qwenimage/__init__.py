"""The Qwen-Image family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

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
from stk.models.layouts import DIFFUSION_MODEL, prefixed, read_component
from stk.models.textmask import TEXT_MASK, masked_sample_inputs, text_mask

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = ["DROPPED_TOKENS", "MAX_SEQUENCE_LENGTH", "PROMPT_TEMPLATE", "SPEC", "QwenImageEncoders", "pack_latents"]

# QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx (set in its __init__)
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROPPED_TOKENS = 34
MAX_SEQUENCE_LENGTH = 1024  # encode_prompt's default max_sequence_length, and the pipeline's tokenizer_max_length
PATCH = 2  # QwenImagePipeline._pack_latents packs 2x2 latent patches into one token
# Qwen/Qwen-Image's scheduler/scheduler_config.json (dynamic shifting; shift_terminal applies at inference only)
SCHEDULER: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)


class QwenImageEncoders(Encoders):
    family = family_of(__name__)
    text_outputs = ("prompt_embeds", TEXT_MASK)
    vae_frames = True

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> QwenImageEncoders:
        qwen = load_text_encoder(
            model,
            "",
            Qwen2Tokenizer,
            Qwen2_5_VLForConditionalGeneration,
            device,
            dtype,
            max_length=MAX_SEQUENCE_LENGTH + DROPPED_TOKENS,
        )
        return cls(model, load_vae(model, device, dtype, SPEC.latents.vae_class), (qwen,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (qwen,) = self.text
        ids, mask = qwen.tokenize([PROMPT_TEMPLATE.format(caption) for caption in captions], padding="longest")
        hidden = qwen.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        kept = [h[m.bool()][DROPPED_TOKENS:] for h, m in zip(hidden, mask, strict=True)]
        embeds = pad_sequence(kept, batch_first=True)  # each caption's real tokens, then zeros
        lengths = torch.tensor([len(k) for k in kept], device=embeds.device)
        real = torch.arange(embeds.shape[1], device=embeds.device)[None] < lengths[:, None]
        return {"prompt_embeds": embeds, TEXT_MASK: real[..., None].to(embeds.dtype)}, lengths


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C), QwenImagePipeline's token layout."""
    b, c, h, w = latents.shape
    packed: torch.Tensor = QwenImagePipeline._pack_latents(latents, b, c, h, w)
    return packed


def _padding_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The mask, or encode_prompt's None where nothing is padding. On the meta device (the benchmarks' FLOP counts)
    no value is known: None, which diffusers' transformer reads without looking at values, for the same FLOPs."""
    return None if mask.device.type == "meta" or bool(mask.all()) else mask


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The packed prediction of noise - latents, the transformer called as the example calls it."""
    b, _, h, w = noisy.shape
    prediction: torch.Tensor = denoiser(
        hidden_states=pack_latents(noisy),
        encoder_hidden_states=inputs.text["prompt_embeds"],
        encoder_hidden_states_mask=_padding_mask(text_mask(inputs.text)),
        timestep=sigmas,  # the example's timesteps / 1000, timesteps = 1000 sigma
        img_shapes=[(1, h // PATCH, w // PATCH)] * b,
        return_dict=False,
    )[0]
    return prediction


def _sample_inputs(embeddings: dict[str, torch.Tensor]) -> dict[str, Any]:
    """QwenImagePipeline takes each prompt's mask beside its embeddings, as `prompt_embeds_mask`."""
    return masked_sample_inputs(embeddings, "prompt_embeds_mask")


def _unreached(denoiser: torch.nn.Module) -> set[str]:
    """The last block's text stream: QwenImageTransformer2DModel returns the image stream only, so its last
    block's text projection and feed-forward never reach the loss (diffusers' model and the published weights have
    them)."""
    blocks: Any = denoiser.transformer_blocks
    last = f"transformer_blocks.{len(blocks) - 1}."
    return {n for n, _ in denoiser.named_parameters() if n.startswith((last + "attn.to_add_out.", last + "txt_mlp."))}


SPEC = FamilySpec(
    name=family_of(__name__),
    title="Qwen-Image",
    pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    pipeline_class=QwenImagePipeline,
    published={"qwen-image": "Qwen-Image"},  # Qwen/Qwen-Image
    text=TextSpec(
        encoders=QwenImageEncoders,
        sequences={"prompt_embeds": "joint_attention_dim", TEXT_MASK: 1},
        tokens=128,
        in_train=False,  # its text encoder loads in stk-cache only
    ),
    latents=LatentSpec(
        vae_class=AutoencoderKLQwenImage,
        patch_size=PATCH,
        pack=pack_latents,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=QwenImageTransformer2DModel,
        flow=True,
        denoise=_denoise,
        lora_targets=ATTENTION_TARGETS,  # the example's default target_modules (no --lora_layers)
        example=Example("examples/dreambooth/train_dreambooth_lora_qwen_image.py"),
        blocks={"num_layers": "transformer_blocks"},
        unreached=_unreached,
    ),
    sampling=SamplingSpec(  # Qwen/Qwen-Image's card
        steps=50,
        guidance=4.0,
        negative_prompt=True,
        inputs=_sample_inputs,
        guidance_argument="true_cfg_scale",  # QwenImagePipeline's guidance_scale is for guidance-distilled models only
    ),
    tiny=TinySpec(
        text={"prompt_embeds": (16, 32), TEXT_MASK: (16, 1)}, latent_channels=16, pipeline_latents=(1, 16, 64)
    ),
    export=ExportSpec(
        # Qwen-Image's own layer names are diffusers' (ComfyUI's too); `_convert_non_diffusers_qwen_lora_to_diffusers`
        kohya_lora=prefixed(DIFFUSION_MODEL),
        # and its checkpoint is the transformer's own weights (from_single_file maps them as they are)
        single_file=lambda folder: read_component(folder / "transformer")[1],
        single_file_class="QwenImageTransformer2DModel",
    ),
)
