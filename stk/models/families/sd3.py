"""Stable Diffusion 3.5 (Large: MMDiT, Medium: MMDiT-X with dual attention in its first 13 blocks; both with QK norm):
a transformer on 2x2 latent patches trained by rectified flow matching, as diffusers' train_dreambooth_sd3.py and
train_dreambooth_lora_sd3.py train it, conditioned as StableDiffusion3Pipeline.encode_prompt conditions it.

Text: CLIP-L's and CLIP-G's penultimate hidden states side by side, zero-padded to T5's width, then T5's last hidden
state (256 tokens) after them on the sequence axis; the pooled vector is both CLIPs' projected text embeddings side by
side. The pipeline masks nothing, so the stored length (what --trim-padding keeps) is all 77 CLIP positions plus T5's
real tokens: trimming drops T5's padding only, never a CLIP position (the transformer attends to that padding, so
trimming is not exact, as for every family that does not mask).

Training, as the examples' defaults: latents (sample - shift) * scale, a sample of the latent distribution; sigmas from
the scheduler's table shifted by its static shift (3.0), indexed by logit-normal draws; the transformer gets timestep =
sigma * 1000; weighting `logit_normal` (ones); and `--precondition_outputs 1`: the prediction becomes noisy - sigma *
prediction and the target the clean latents (the velocity MSE weighted by sigma^2).

Sample images: 28 steps and guidance 3.5 with the empty caption as the negative prompt, as SD3.5 Large's model card
runs it. The pipeline's own defaults (28, 7.0) are those of SD3 Medium, the 2024 model; SD3.5 Medium's card asks 40
steps and 4.5 (`--validation-steps`, `--validation-guidance`). One family, one default: the larger model's, and the
fewer steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import Family
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.layouts import Blocks, Fuse, block_layout, block_weights, read_component

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

__all__ = ["SPEC", "T5_MAX_LENGTH", "SD3Encoders"]

T5_MAX_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length
TRAIN_TIMESTEPS = 1000  # the scheduler's num_train_timesteps: the transformer takes timestep = sigma * 1000
PATCH = 2

# SD3.5's own layer names (Stability's MM-DiT, ComfyUI's), the inverse of diffusers' convert_sd3_transformer_checkpoint_
# to_diffusers: each block a joint block of an image (x_block) and a text (context_block) half, q, k and v one `qkv`;
# SD3.5 Medium's second image attention `attn2`. A LoRA goes under `diffusion_model.`; diffusers has no reader of
# those for SD3 (SD3LoraLoaderMixin reads its own names only).
BLOCKS = (
    Blocks(
        "transformer_blocks.",
        "joint_blocks.",
        renames=(
            ("attn.to_out.0", "x_block.attn.proj"),
            ("attn.to_add_out", "context_block.attn.proj"),
            ("attn2.to_out.0", "x_block.attn2.proj"),
            ("ff.net.0.proj", "x_block.mlp.fc1"),
            ("ff.net.2", "x_block.mlp.fc2"),
            ("ff_context.net.0.proj", "context_block.mlp.fc1"),
            ("ff_context.net.2", "context_block.mlp.fc2"),
            ("norm1.linear", "x_block.adaLN_modulation.1"),
            ("norm1_context.linear", "context_block.adaLN_modulation.1"),
            ("attn.norm_q", "x_block.attn.ln_q"),
            ("attn.norm_k", "x_block.attn.ln_k"),
            ("attn.norm_added_q", "context_block.attn.ln_q"),
            ("attn.norm_added_k", "context_block.attn.ln_k"),
            ("attn2.norm_q", "x_block.attn2.ln_q"),
            ("attn2.norm_k", "x_block.attn2.ln_k"),
        ),
        fusions=(
            Fuse("x_block.attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
            Fuse("context_block.attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
            Fuse("x_block.attn2.qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v")),
        ),
    ),
)
TOP = (
    ("pos_embed.proj", "x_embedder.proj"), ("context_embedder", "context_embedder"),
    ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"), ("proj_out", "final_layer.linear"),
)  # fmt: skip
FINAL_NORM = "final_layer.adaLN_modulation.1"  # shift before scale there, scale before shift in diffusers
KOHYA_LORA = block_layout(BLOCKS, TOP, swaps=(FINAL_NORM,))


def single_file(folder: Path) -> dict[str, torch.Tensor]:
    """The transformer of the pipeline in `folder` as Stability's checkpoint names it (SD3Transformer2DModel
    .from_single_file, ComfyUI's diffusion_models/): the last block's text modulation swapped like the final norm's
    (that block's text half only modulates), the position table as `pos_embed`."""
    state = read_component(folder / "transformer")[1]
    table = state.pop("pos_embed.pos_embed")
    last = max(int(key.split(".")[1]) for key in state if key.startswith("transformer_blocks."))
    swaps = (FINAL_NORM, f"joint_blocks.{last}.context_block.adaLN_modulation.1")
    return {"pos_embed": table, **block_weights(BLOCKS, TOP, state, swaps=swaps)}


# diffusers' train_dreambooth_lora_sd3.py, target_modules without --lora_layers: both streams' attention projections.
# Medium's second image attention (`attn2`) is not among them, as there.
LORA_TARGETS = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)  # fmt: skip


class SD3Encoders(Encoders):
    family = Family.SD3
    text_outputs = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> SD3Encoders:
        clip = load_text_encoder(model, "", CLIPTokenizer, CLIPTextModelWithProjection, device, dtype)
        clip_2 = load_text_encoder(model, "_2", CLIPTokenizer, CLIPTextModelWithProjection, device, dtype)
        t5 = load_text_encoder(model, "_3", T5Tokenizer, T5EncoderModel, device, dtype, max_length=T5_MAX_LENGTH)
        return cls(model, load_vae(model, device, dtype), (clip, clip_2, t5))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        *clips, t5 = self.text
        hidden, pooled = [], []
        for clip in clips:
            ids, _ = clip.tokenize(captions)
            output = clip.model(ids, output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
            pooled.append(output.text_embeds)
        ids_3, mask_3 = t5.tokenize(captions)
        t5_embeds = t5.model(ids_3).last_hidden_state
        clip_embeds = torch.cat(hidden, dim=-1)
        clip_embeds = F.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        outputs = {
            "prompt_embeds": torch.cat([clip_embeds, t5_embeds], dim=-2),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),
        }
        return outputs, clip_embeds.shape[1] + mask_3.sum(dim=1)


def _denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    prediction: torch.Tensor = denoiser(
        hidden_states=noisy,
        timestep=sigmas * TRAIN_TIMESTEPS,
        encoder_hidden_states=inputs.text["prompt_embeds"],
        pooled_projections=inputs.text["pooled_prompt_embeds"],
        return_dict=False,
    )[0]
    return prediction


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    # CLIP-L and CLIP-G widths in the published ratio (768 + 1280 = 2048), so a published transformer gets encoders of
    # the widths it reads; tokenizer_2 pads with "!" as SD3's does.
    pooled = transformer.config.pooled_projection_dim if transformer is not None else 128
    tokenizer, tokenizer_2 = (
        tiny.clip_tokenizer(scratch / "tokenizer"),
        tiny.clip_tokenizer(scratch / "tokenizer_2", "!"),
    )
    tokenizer_3 = tiny.t5_tokenizer(scratch / "tokenizer_3", T5_MAX_LENGTH)
    t5 = tiny.t5(tokenizer_3, transformer.config.joint_attention_dim if transformer is not None else 160)  # > CLIPs'
    transformer = transformer or SD3Transformer2DModel(
        sample_size=8,
        patch_size=PATCH,
        in_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=t5.config.d_model,
        caption_projection_dim=32,  # the blocks' width: heads x head dim
        pooled_projection_dim=pooled,
        out_channels=16,
        pos_embed_max_size=32,
        dual_attention_layers=(0,),  # like SD3.5 Medium's first blocks
        qk_norm="rms_norm",
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae or tiny.vae(16, 1.5305, shift_factor=0.0609),
        text_encoder=tiny.clip(tokenizer, pooled * 3 // 8, projection=True),
        text_encoder_2=tiny.clip(tokenizer_2, pooled - pooled * 3 // 8, projection=True),
        text_encoder_3=t5,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
        image_encoder=None,
        feature_extractor=None,
    )


SPEC = FamilySpec(
    name=Family.SD3,
    title="SD3.5",
    pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    pipeline_class=StableDiffusion3Pipeline,
    encoders=SD3Encoders,
    denoiser_subfolder="transformer",
    denoiser_class=SD3Transformer2DModel,
    flow=True,
    denoise=_denoise,
    lora_targets=LORA_TARGETS,
    sampling=Sampling(steps=28, guidance=3.5, negative_prompt=True),
    example=Example("examples/dreambooth/train_dreambooth_lora_sd3.py", timestep_sampling="logit-normal"),
    published=("sd35-large", "sd35-medium"),  # stabilityai/stable-diffusion-3.5-large, -medium
    tiny=_tiny,
    patch_size=PATCH,
    precondition_outputs=True,
    kohya_lora=KOHYA_LORA,
    single_file=single_file,
    single_file_class="SD3Transformer2DModel",
)
