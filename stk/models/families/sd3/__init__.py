"""The SD3.5 family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stk.models.base import Encoders
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

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

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
    ("pos_embed.proj", "x_embedder.proj"),
    ("context_embedder", "context_embedder"),
    ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
    ("proj_out", "final_layer.linear"),
)
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
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)


class SD3Encoders(Encoders):
    family = family_of(__name__)
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


SPEC = FamilySpec(
    name=family_of(__name__),
    title="SD3.5",
    pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    pipeline_class=StableDiffusion3Pipeline,
    published={
        "sd35-large": "SD3.5 Large",
        "sd35-medium": "SD3.5 Medium",
    },  # stabilityai/stable-diffusion-3.5-large, -medium
    text=TextSpec(
        encoders=SD3Encoders,
        sequences={"prompt_embeds": "joint_attention_dim"},
        pooled={"pooled_prompt_embeds": "pooled_projection_dim"},
        tokens=77 + T5_MAX_LENGTH,
    ),
    latents=LatentSpec(
        patch_size=PATCH,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=SD3Transformer2DModel,
        flow=True,
        denoise=_denoise,
        lora_targets=LORA_TARGETS,
        example=Example("examples/dreambooth/train_dreambooth_lora_sd3.py", timestep_sampling="logit-normal"),
        precondition_outputs=True,
        blocks={"num_layers": "transformer_blocks"},
        measured_blocks=2,
    ),
    sampling=SamplingSpec(steps=28, guidance=3.5, negative_prompt=True),
    tiny=TinySpec(
        text={"prompt_embeds": (77 + 16, 160), "pooled_prompt_embeds": (128,)},
        latent_channels=16,
        pipeline_latents=(1, 16, 8, 8),
    ),
    export=ExportSpec(
        kohya_lora=KOHYA_LORA,
        single_file=single_file,
        single_file_class="SD3Transformer2DModel",
    ),
)
