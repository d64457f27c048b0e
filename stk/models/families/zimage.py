"""Z-Image (Tongyi-MAI): a single-stream flow transformer conditioned on Qwen3's second-to-last hidden state, trained
as diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py trains it.

- Text (ZImagePipeline._encode_prompt): each caption in Qwen3's chat template (a user turn, then the assistant's,
  thinking enabled), padded to 512 tokens, `hidden_states[-2]` under the attention mask; the pipeline hands the
  transformer each caption's real tokens only, so the cache stores those and a TEXT_MASK.
- Latents: the FLUX.1 VAE's, shifted and scaled (the example's `(x - shift_factor) * scaling_factor`).
- Loss: noisy = (1 - sigma) x + sigma n; the transformer takes a list of (C, 1, h, w) latents, the timestep
  1 - sigma (the example's `(1000 - t) / 1000`, t = 1000 sigma) and a list of per-caption embeddings; its output is
  negated; target noise - latents. The example's default weighting ("none") weighs every sample alike, and its
  per-sample mean then mean is the plain mean here (one bucket: equal sizes). No packing: the transformer patchifies
  2x2 itself.
- Sigmas: as the example, uniform draws index the scheduler's table, shifted by its static shift (Tongyi-MAI/Z-Image
  ships shift 6, no dynamic shifting). Latents: the mode of the distribution (`latent_dist.mode()`), so stk-cache
  stores the mean only by default.
- Samples: the base model's card, 50 steps and classifier-free guidance 4 with the empty caption as the negative
  prompt (the distilled Z-Image-Turbo samples in 8-9 steps at guidance 0: pass --validation-steps and
  --validation-guidance).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.chat import chat_prompts
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import Family
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.layouts import Blocks, Fuse, block_layout, block_weights, read_component
from stk.models.textmask import TEXT_MASK, masked_prompts, text_mask

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

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
    family = Family.ZIMAGE
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


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.qwen_tokenizer(scratch / "tokenizer")
    width = transformer.config.cap_feat_dim if transformer is not None else 32
    qwen = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=MAX_SEQUENCE_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = transformer or ZImageTransformer2DModel(
        all_patch_size=(PATCH,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=width,
        axes_dims=[4, 6, 6],  # sums to the head width, 16
        axes_lens=[1536, 512, 512],
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=TRAIN_TIMESTEPS, shift=6.0),  # Z-Image's
        vae=vae or tiny.vae(16, 0.3611, shift_factor=0.1159),
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=transformer,
    )


SPEC = FamilySpec(
    name=Family.ZIMAGE,
    title="Z-Image",
    pipelines=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"),
    pipeline_class=ZImagePipeline,
    encoders=ZImageEncoders,
    denoiser_subfolder="transformer",
    denoiser_class=ZImageTransformer2DModel,
    flow=True,
    denoise=_denoise,
    lora_targets=LORA_TARGETS,
    sampling=Sampling(steps=50, guidance=4.0, negative_prompt=True),  # Tongyi-MAI/Z-Image's card
    example=Example("examples/dreambooth/train_dreambooth_lora_z_image.py", samples_latents=False),
    published=("zimage",),  # Tongyi-MAI/Z-Image
    tiny=_tiny,
    patch_size=PATCH,
    sample_inputs=_sample_inputs,
    kohya_lora=KOHYA_LORA,
    single_file=single_file,
    single_file_class="ZImageTransformer2DModel",
)
