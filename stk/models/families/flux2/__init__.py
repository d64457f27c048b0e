"""The FLUX.2-dev family: its spec, SPEC, and the code it needs. README.md beside this file is its page."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, compute_empirical_mu, format_input
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

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
from stk.models.latents import LatentNorm
from stk.models.layouts import Blocks, Fuse, block_layout, block_weights, peft_entries, read_component
from stk.models.model_json import read_model_json

if TYPE_CHECKING:
    from stk.models.interface import StepInputs

__all__ = [
    "BLOCKS",
    "HIDDEN_STATES_LAYERS",
    "KOHYA_LORA",
    "LORA_TARGETS",
    "MAX_SEQUENCE_LENGTH",
    "PATCH",
    "SPEC",
    "TOP",
    "VAE_CLASS",
    "Flux2DevEncoders",
    "Flux2Encoders",
    "denoise",
    "pack",
    "patchify",
    "single_file",
    "stacked_hidden_states",
]

PATCH = 2  # the pipelines' _patchify_latents folds 2x2 latent patches into channels; the transformer's patch is 1
MAX_SEQUENCE_LENGTH = 512  # the pipelines' default max_sequence_length
VAE_CLASS = AutoencoderKLFlux2
SAMPLING = SamplingSpec(steps=50, guidance=4.0, negative_prompt=False)  # Flux2Pipeline's defaults
HIDDEN_STATES_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers (the example's too)

# FLUX.2's own layer names (black-forest-labs/flux2), the inverse of diffusers' convert_flux2_transformer_checkpoint_to_
# diffusers: q, k and v one `qkv` layer; the single blocks' fused projection `linear1` as diffusers has it too.
BLOCKS = (
    Blocks(
        "transformer_blocks.",
        "double_blocks.",
        renames=(
            ("attn.to_out.0", "img_attn.proj"),
            ("attn.to_add_out", "txt_attn.proj"),
            ("ff.linear_in", "img_mlp.0"),
            ("ff.linear_out", "img_mlp.2"),
            ("ff_context.linear_in", "txt_mlp.0"),
            ("ff_context.linear_out", "txt_mlp.2"),
            ("attn.norm_q", "img_attn.norm.query_norm"),
            ("attn.norm_k", "img_attn.norm.key_norm"),
            ("attn.norm_added_q", "txt_attn.norm.query_norm"),
            ("attn.norm_added_k", "txt_attn.norm.key_norm"),
        ),
        fusions=(
            Fuse("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
            Fuse("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
        ),
    ),
    Blocks(
        "single_transformer_blocks.",
        "single_blocks.",
        renames=(
            ("attn.to_qkv_mlp_proj", "linear1"),
            ("attn.to_out", "linear2"),
            ("attn.norm_q", "norm.query_norm"),
            ("attn.norm_k", "norm.key_norm"),
        ),
    ),
)
TOP = (
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("proj_out", "final_layer.linear"),
    ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    ("single_stream_modulation.linear", "single_stream_modulation.lin"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
)
SWAPS = ("final_layer.adaLN_modulation.1",)  # shift before scale there, scale before shift in diffusers
# A LoRA under them and `diffusion_model.`, as ComfyUI and ai-toolkit store one and diffusers'
# `_convert_non_diffusers_flux2_lora_to_diffusers` reads it back: lora_A/lora_B, the scale folded in (no alpha).
KOHYA_LORA = block_layout(BLOCKS, TOP, entries=peft_entries, swaps=SWAPS)


def single_file(folder: Path) -> dict[str, torch.Tensor]:
    """The transformer of the pipeline in `folder` as BFL's checkpoint holds it (Flux2Transformer2DModel
    .from_single_file, ComfyUI's diffusion_models/)."""
    state = read_component(folder / "transformer")[1]
    return block_weights(
        BLOCKS, TOP, state, swaps=("final_layer.adaLN_modulation.1",), norms=("query_norm", "key_norm")
    )


# The examples' default target_modules: the double blocks' attention projections (`to_q/k/v`, `to_out.0`), the single
# blocks' fused input projection (`to_qkv_mlp_proj`) and their output projection, which the examples list by index
# (`single_transformer_blocks.{i}.attn.to_out`, i < 48 for dev, < 24 for klein). `attn.to_out` names those at any
# depth: in the double blocks it is a list, which stk.train.trainable.lora.add_lora leaves out.
LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out")


# the benchmarks' block counts: config key -> the transformer's list of those blocks
BLOCK_COUNTS = {"num_layers": "transformer_blocks", "num_single_layers": "single_transformer_blocks"}


class Flux2Encoders(Encoders):
    """What the FLUX.2 families' encoders share: the VAE's normalisation, its batch norm's running statistics over
    2x2 patches, as the example computes `latents_bn_mean` and `latents_bn_std`."""

    def _latent_norm(self) -> LatentNorm:
        bn = self.vae.bn
        mean = bn.running_mean.detach().float().cpu()
        std = torch.sqrt(bn.running_var.detach().float().cpu() + self.vae.config.batch_norm_eps)
        return LatentNorm(mean=tuple(mean.tolist()), std=tuple(std.tolist()), patch=PATCH)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), the pipelines' _patchify_latents."""
    patched: torch.Tensor = Flux2KleinPipeline._patchify_latents(latents)
    return patched


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): patchified, then each position one token (the pipelines' _pack_latents)."""
    packed: torch.Tensor = Flux2KleinPipeline._pack_latents(patchify(latents))
    return packed


def stacked_hidden_states(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The pipelines' prompt embeddings: the (B, L, D) hidden states of `layers`, side by side -> (B, L, len * D)."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)
    b, n, length, width = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * width)


def denoise(
    objective: DenoiseSettings, denoiser: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, inputs: StepInputs
) -> torch.Tensor:
    """The packed (B, h/2 * w/2, 4C) prediction of noise - latents, with the ids (and guidance) the pipelines give."""
    module: Any = getattr(denoiser, "module", denoiser)  # a DeepSpeed engine holds the model as .module
    b, device = noisy.shape[0], noisy.device
    guidance = torch.full((b,), objective.guidance_scale, device=device) if module.config.guidance_embeds else None
    prompt_embeds = inputs.text["prompt_embeds"]
    prediction: torch.Tensor = denoiser(
        hidden_states=pack(noisy),
        timestep=sigmas,  # the example's timesteps / 1000, with timesteps = 1000 sigma
        guidance=guidance,
        encoder_hidden_states=prompt_embeds,
        txt_ids=Flux2KleinPipeline._prepare_text_ids(prompt_embeds).to(device),
        img_ids=Flux2KleinPipeline._prepare_latent_ids(patchify(noisy)).to(device),
        return_dict=False,
    )[0]
    return prediction


class Flux2DevEncoders(Flux2Encoders):
    family = family_of(__name__)
    text_outputs = ("prompt_embeds",)

    @classmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> Flux2DevEncoders:
        mistral = load_text_encoder(
            model, "", AutoTokenizer, Mistral3ForConditionalGeneration, device, dtype, max_length=MAX_SEQUENCE_LENGTH
        )
        if mistral.tokenizer.chat_template is None:  # a processor saved before chat_template.jinja: its older file
            mistral.tokenizer.chat_template = read_model_json(model, "tokenizer/chat_template.json")["chat_template"]
        return cls(model, load_vae(model, device, dtype, VAE_CLASS), (mistral,))

    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (mistral,) = self.text
        chats: Any = mistral.tokenizer.apply_chat_template(
            format_input(prompts=captions, system_message=SYSTEM_MESSAGE),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=mistral.max_length,
        )
        ids, mask = chats["input_ids"].to(mistral.model.device), chats["attention_mask"].to(mistral.model.device)
        hidden = mistral.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        return {"prompt_embeds": stacked_hidden_states(hidden.hidden_states, HIDDEN_STATES_LAYERS)}, mask.sum(dim=1)


def empirical_mu(_config: Mapping[str, Any], image_seq_len: int) -> float:
    """The mu Flux2Pipeline and Flux2KleinPipeline shift their schedule by: fitted to the image's tokens and the
    number of steps (at their default steps), not read from the scheduler config."""
    return compute_empirical_mu(image_seq_len, SAMPLING.steps)


SPEC = FamilySpec(
    name=family_of(__name__),
    title="FLUX.2-dev",
    pipelines=("Flux2Pipeline",),  # text to image and image editing alike
    pipeline_class=Flux2Pipeline,
    published={"flux2-dev": "FLUX.2-dev"},  # black-forest-labs/FLUX.2-dev
    text=TextSpec(
        encoders=Flux2DevEncoders,
        sequences={"prompt_embeds": "joint_attention_dim"},
        tokens=MAX_SEQUENCE_LENGTH,
        in_train=False,  # its text encoder loads in stk-cache only
    ),
    latents=LatentSpec(
        vae_class=VAE_CLASS,
        patch_size=PATCH,
        pack=pack,
    ),
    denoiser=DenoiserSpec(
        subfolder="transformer",
        model_class=Flux2Transformer2DModel,
        flow=True,
        denoise=denoise,
        lora_targets=LORA_TARGETS,
        example=Example("examples/dreambooth/train_dreambooth_lora_flux2.py", samples_latents=False),
        inference_mu=empirical_mu,
        blocks=BLOCK_COUNTS,
    ),
    sampling=SAMPLING,
    tiny=TinySpec(text={"prompt_embeds": (16, 48)}, latent_channels=8, pipeline_latents=(1, 16, 32)),
    export=ExportSpec(
        kohya_lora=KOHYA_LORA,
        single_file=single_file,
        single_file_class="Flux2Transformer2DModel",
    ),
)
