"""Qwen-Image (Qwen): a double-stream (MMDiT) flow transformer on 2x2 latent patches packed into tokens, conditioned on
Qwen2.5-VL's last hidden state, trained as diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py trains
it.

- Text (QwenImagePipeline._get_qwen_prompt_embeds): each caption in the pipeline's prompt template (a system turn that
  asks for a detailed description, the caption as the user's turn, then the assistant's), padded to the batch's
  longest, `hidden_states[-1]` under the attention mask; the first 34 tokens (the system turn and the user turn's
  opening) are dropped and each caption keeps its real tokens only, at most 1024 (encode_prompt's default, which the
  example uses). The pipeline hands the transformer a mask over them, so the cache stores those tokens and a
  TEXT_MASK; a batch without padding gets no mask, as encode_prompt does.
- Latents: AutoencoderKLQwenImage is a video VAE (B, C, T, H, W): an image is one frame (Encoders.vae_frames), and
  its latents are normalised per channel, `(x - latents_mean) / latents_std` (stk.models.latents).
- Loss: noisy = (1 - sigma) x + sigma n, packed as QwenImagePipeline._pack_latents (the frame axis of one changes
  nothing there); the transformer takes the timestep sigma (the example's `timesteps / 1000`), the text mask and the
  packed grid (`img_shapes`); target noise - latents, compared packed (the example unpacks the prediction instead:
  the same mean). The example's default weighting ("none") weighs every sample alike.
- Sigmas: as the example, uniform draws index the scheduler's unshifted table (its scheduler shifts dynamically, at
  inference only; the example's `shift=3.0` changes nothing then); `--flow-shift auto` shifts them as the pipeline
  shifts its schedule for the image's token count.
- Latents: the example trains on a sample of the latent distribution (`latent_dist.sample()`): stk-cache stores its
  log-variance by default.
- Samples: the model card's 50 steps and true classifier-free guidance 4 (`true_cfg_scale`) with a negative prompt
  (the card's is " "; stk's is the empty caption, as for every family).
Qwen-Image-Edit (its own template, image conditioning) and Qwen-Image 2.1 (another transformer, VAE and encoder) are
other families.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import Family
from stk.models.families.sd import ATTENTION_TARGETS
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.layouts import DIFFUSION_MODEL, prefixed, read_component
from stk.models.textmask import TEXT_MASK, masked_sample_inputs, text_mask

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

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
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
    time_shift_type="exponential", use_dynamic_shifting=True,
)  # fmt: skip


class QwenImageEncoders(Encoders):
    family = Family.QWENIMAGE
    text_outputs = ("prompt_embeds", TEXT_MASK)
    vae_frames = True

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> QwenImageEncoders:
        qwen = load_text_encoder(
            model, "", Qwen2Tokenizer, Qwen2_5_VLForConditionalGeneration, device, dtype,
            max_length=MAX_SEQUENCE_LENGTH + DROPPED_TOKENS,
        )  # fmt: skip
        return cls(model, load_vae(model, device, dtype, SPEC.vae_class), (qwen,))

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


def _text_encoder(tokenizer: Any, width: int) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL two layers deep, its text model `width` wide (the transformer's joint_attention_dim); the vision
    tower, which text encoding never runs, one small block."""
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},  # half of head width 8
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    # the template's words are single tokens, as in Qwen's vocabulary: the 34 dropped tokens are the same ones
    words = re.findall(r"[A-Za-z]+", re.sub(r"<\|\w+\|>", "", PROMPT_TEMPLATE))
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer", tiny.merge_order((*words, *tiny.WORDS)))
    transformer = transformer or QwenImageTransformer2DModel(
        patch_size=PATCH, in_channels=4 * 16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae or AutoencoderKLQwenImage(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),  # Qwen-Image's stats
        text_encoder=_text_encoder(tokenizer, transformer.config.joint_attention_dim),
        tokenizer=tokenizer,
        transformer=transformer,
    )


SPEC = FamilySpec(
    name=Family.QWENIMAGE,
    title="Qwen-Image",
    pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    pipeline_class=QwenImagePipeline,
    encoders=QwenImageEncoders,
    denoiser_subfolder="transformer",
    denoiser_class=QwenImageTransformer2DModel,
    flow=True,
    denoise=_denoise,
    lora_targets=ATTENTION_TARGETS,  # the example's default target_modules (no --lora_layers)
    sampling=Sampling(steps=50, guidance=4.0, negative_prompt=True),  # Qwen/Qwen-Image's card
    example=Example("examples/dreambooth/train_dreambooth_lora_qwen_image.py"),
    published=("qwen-image",),  # Qwen/Qwen-Image
    tiny=_tiny,
    patch_size=PATCH,
    pack=pack_latents,
    sample_inputs=_sample_inputs,
    vae_class=AutoencoderKLQwenImage,
    guidance_argument="true_cfg_scale",  # QwenImagePipeline's guidance_scale is for guidance-distilled models only
    text_encoders_in_train=False,  # its text encoder loads in stk-cache only
    # Qwen-Image's own layer names are diffusers' (ComfyUI's too); `_convert_non_diffusers_qwen_lora_to_diffusers`
    kohya_lora=prefixed(DIFFUSION_MODEL),
    # and its checkpoint is the transformer's own weights (from_single_file maps them as they are)
    single_file=lambda folder: read_component(folder / "transformer")[1],
    single_file_class="QwenImageTransformer2DModel",
)
