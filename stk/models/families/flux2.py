"""FLUX.2-dev (32B), and what the FLUX.2 families (FLUX.2-dev here, FLUX.2-klein in flux2_klein.py) share, as
diffusers' Flux2Pipeline and Flux2KleinPipeline and their training examples (examples/dreambooth/
train_dreambooth_lora_flux2.py, train_dreambooth_lora_flux2_klein.py) do it.

Shared: the VAE, the latents' normalisation, packing and position ids, and the transformer's training call.
- Latents: AutoencoderKLFlux2's distribution is patchified 2x2 (32 channels -> 128 at half the size) and normalised
  by the VAE's batch-norm running statistics, `(x - running_mean) / sqrt(running_var + batch_norm_eps)` per patch
  channel (the example's `latents_bn_mean`/`latents_bn_std`). stk keeps latents in the VAE's (B, C, h, w) layout and
  normalises each position by its patch channel's statistics (LatentNorm with patch 2): the same numbers.
- Loss: noisy = (1 - sigma) x + sigma n; the transformer takes the 2x2 patches packed into tokens (B, h/2 * w/2,
  4C), the timestep sigma (the example's `timesteps / 1000`), the text ids (0, 0, 0, l) and the image ids
  (0, row, column, 0); target noise - latents, compared in the packed layout (the example unpacks the prediction
  instead: the same elements). A guidance-distilled transformer (FLUX.2-dev: `guidance_embeds`) takes the guidance
  scale too: the example's --guidance_scale, 3.5 (stk-train's --guidance-scale). The example's default weighting
  ("none") weighs every sample alike.
- Text: the pipeline stacks the hidden states of three layers of its text encoder along the features, every one of
  the max_sequence_length positions (the transformer attends to the padding: no mask).

FLUX.2-dev (train_dreambooth_lora_flux2.py):
- Text (Flux2Pipeline._get_mistral_3_small_prompt_embeds): each caption as a chat, the pipeline's SYSTEM_MESSAGE as
  the system turn and the caption as the user's (its `format_input`), in the chat template, padded to 512 tokens;
  the hidden states of layers 10, 20 and 30 of Mistral-Small-3 (3.2-24B-Instruct's weights, 3.1's processor, as
  diffusers' scripts/convert_flux2_to_diffusers.py builds the pipeline; Mistral3ForConditionalGeneration, the whole
  model as the pipeline loads it) side by side, 3 x 5120. The pipeline's tokenizer/ is a PixtralProcessor; stk loads
  its tokenizer alone (the processor's image half needs torchvision and takes no part in text) with the chat
  template saved beside it (chat_template.jinja, or an older processor's chat_template.json): for text alone the
  processor's apply_chat_template is its tokenizer's.
- Sigmas: the example's, from the scheduler's unshifted table (the scheduler shifts dynamically, at inference
  only); `--flow-shift auto` shifts them as Flux2Pipeline does, by compute_empirical_mu at its default 50 steps.
  Latents: the mode of the distribution (`latent_dist.mode()`), so stk-cache stores the mean only by default.
- Samples: the pipeline's defaults, 50 steps at embedded guidance 4, no negative prompt (guidance-distilled).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, compute_empirical_mu, format_input
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration

from stk.models import tinyparts as tiny
from stk.models.base import Encoders
from stk.models.components import load_text_encoder, load_vae
from stk.models.families.registry import Family
from stk.models.families.spec import DenoiseSettings, Example, FamilySpec, Sampling
from stk.models.latents import LatentNorm
from stk.models.layouts import Blocks, Fuse, block_layout, block_weights, peft_entries, read_component
from stk.models.model_json import read_model_json

if TYPE_CHECKING:
    from stk.train.batch import StepInputs

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
    "tiny_pipeline",
    "tiny_text_width",
    "tiny_transformer",
    "tiny_vae",
]

PATCH = 2  # the pipelines' _patchify_latents folds 2x2 latent patches into channels; the transformer's patch is 1
MAX_SEQUENCE_LENGTH = 512  # the pipelines' default max_sequence_length
VAE_CLASS = AutoencoderKLFlux2
SAMPLING = Sampling(steps=50, guidance=4.0, negative_prompt=False)  # Flux2Pipeline's defaults
TINY_TEXT_WIDTH = 16
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
# depth: in the double blocks it is a list, which stk.train.lora.add_lora leaves out.
LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out")


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


def tiny_vae(latent_channels: int = 8) -> AutoencoderKLFlux2:
    """Four blocks like the real one (8x down); random batch-norm statistics, so that normalising shows."""
    vae = AutoencoderKLFlux2(block_out_channels=(32, 64, 64, 64), layers_per_block=1, latent_channels=latent_channels,
                             sample_size=64)  # fmt: skip
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    return vae


def tiny_text_width(transformer: Any) -> int:
    """The tiny text encoder's width for `transformer`, whose text width is three of its layers side by side; for a
    tiny transformer, TINY_TEXT_WIDTH."""
    return int(transformer.config.joint_attention_dim) // 3 if transformer is not None else TINY_TEXT_WIDTH


def tiny_pipeline(
    text_encoder: Any, tokenizer: Any, transformer: Any, vae: Any, guidance_embeds: bool
) -> dict[str, Any]:
    """A FLUX.2 pipeline's components around a tiny text encoder: `transformer` and `vae` where given, else tiny
    ones; FLUX.1-dev's scheduler, as the published pipelines have it."""
    vae = vae or tiny_vae()
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer or tiny_transformer(vae.config.latent_channels, 3 * TINY_TEXT_WIDTH, guidance_embeds),
    )


def tiny_transformer(latent_channels: int, text_width: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """One double and two single blocks of width 32 (two heads of 16), reading 2x2 patches of `latent_channels`."""
    return Flux2Transformer2DModel(
        in_channels=PATCH * PATCH * latent_channels,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_width,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head width
        guidance_embeds=guidance_embeds,
    )


class Flux2DevEncoders(Flux2Encoders):
    family = Family.FLUX2
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


def _tiny(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    """Mistral3 with a text model deep enough for layer 30 and a one-layer vision tower, all 16 wide; its tokenizer
    saved as a tokenizer (a PixtralProcessor needs torchvision), which the pipeline uses alike for text."""
    tokenizer = tiny.mistral_tokenizer(scratch / "tokenizer")
    text = dict(vocab_size=len(tokenizer), hidden_size=tiny_text_width(transformer), intermediate_size=32, head_dim=8,
                num_hidden_layers=max(HIDDEN_STATES_LAYERS) + 1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=MAX_SEQUENCE_LENGTH, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=56, patch_size=14)  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=tokenizer.get_vocab()["[IMG]"])
    return tiny_pipeline(Mistral3ForConditionalGeneration(config), tokenizer, transformer, vae, guidance_embeds=True)


def empirical_mu(_config: Mapping[str, Any], image_seq_len: int) -> float:
    """The mu Flux2Pipeline and Flux2KleinPipeline shift their schedule by: fitted to the image's tokens and the
    number of steps (at their default steps), not read from the scheduler config."""
    return compute_empirical_mu(image_seq_len, SAMPLING.steps)


SPEC = FamilySpec(
    name=Family.FLUX2,
    title="FLUX.2-dev",
    pipelines=("Flux2Pipeline",),  # text to image and image editing alike
    pipeline_class=Flux2Pipeline,
    encoders=Flux2DevEncoders,
    denoiser_subfolder="transformer",
    denoiser_class=Flux2Transformer2DModel,
    flow=True,
    denoise=denoise,
    lora_targets=LORA_TARGETS,
    sampling=SAMPLING,
    example=Example("examples/dreambooth/train_dreambooth_lora_flux2.py", samples_latents=False),
    published=("flux2-dev",),  # black-forest-labs/FLUX.2-dev
    tiny=_tiny,
    patch_size=PATCH,
    pack=pack,
    vae_class=VAE_CLASS,
    inference_mu=empirical_mu,
    text_encoders_in_train=False,  # its text encoder loads in stk-cache only
    kohya_lora=KOHYA_LORA,
    single_file=single_file,
    single_file_class="Flux2Transformer2DModel",
)
