"""Random-weight pipelines of each family, laid out and loaded exactly like the real models (model_index.json and one
subfolder per component, denoiser included), built offline: tiny ones for tests and the demo (about a second), and
ones with a published denoiser and VAE (stk.models.published) and tiny text encoders of the widths that denoiser
reads, for benchmarks on real architectures (text embeddings are cached, so their encoders' depth does not matter)."""

from __future__ import annotations

import json
import string
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    PNDMScheduler,
    UNet2DConditionModel,
)

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from tokenizers import Tokenizer
from tokenizers.models import Unigram
from tokenizers.pre_tokenizers import ByteLevel, Metaspace
from tokenizers.processors import TemplateProcessing
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from stk.models.detect import Family
from stk.models.flux import T5_MAX_LENGTH
from stk.models.published import PUBLISHED, build_published, published_config

__all__ = ["build_published_model", "build_tiny_model"]

# Words that become single tokens, so captions tokenize into something like real subwords.
WORDS = ("a", "an", "the", "photo", "of", "cat", "dog", "on", "in", "with", "and", "red", "blue", "painting", "man")
CLIP_LENGTH = 77
SD_BETAS: dict[str, Any] = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def _checked(tokenizer: PreTrainedTokenizerBase, expected: int) -> PreTrainedTokenizerBase:
    """from_pretrained can return an empty tokenizer instead of raising (FACTS.md): fail here, not in a later test."""
    if len(tokenizer) != expected:
        raise RuntimeError(f"tiny {type(tokenizer).__name__} loaded {len(tokenizer)} tokens, expected {expected}")
    return tokenizer


def _clip_tokenizer(folder: Path, pad_token: str = "<|endoftext|>") -> PreTrainedTokenizerBase:
    """CLIP's byte-level BPE from a hand-written vocab.json + merges.txt: every byte alone and word-final ('</w>'),
    and merges that join each of WORDS left to right."""
    alphabet = sorted(ByteLevel.alphabet())
    merges: dict[tuple[str, str], None] = {}
    for word in WORDS:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merges[(parts[0], parts[1])] = None
            parts = [parts[0] + parts[1], *parts[2:]]
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), *(a + b for a, b in merges)]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer.from_pretrained(folder, pad_token=pad_token, model_max_length=CLIP_LENGTH)
    return _checked(tokenizer, len(vocab))


def _t5_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """T5's Unigram (sentencepiece) model built with the tokenizers library: every printable ASCII character alone
    and at a word start ('▁'), plus WORDS; equal scores, so the fewest pieces win and words stay whole."""
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = dict.fromkeys(["▁", *chars, *("▁" + c for c in chars), *("▁" + w for w in WORDS)])
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((piece, -1.0) for piece in pieces)]
    backend = Tokenizer(Unigram(vocab, unk_id=2))
    backend.pre_tokenizer = Metaspace()
    backend.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    tokenizer = T5Tokenizer.from_pretrained(folder, extra_ids=0, model_max_length=T5_MAX_LENGTH)
    return _checked(tokenizer, len(vocab))


def _clip(tokenizer: PreTrainedTokenizerBase, hidden: int, projection: bool = False) -> PreTrainedModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _vae(latent_channels: int, scaling_factor: float, shift_factor: float | None = None) -> AutoencoderKL:
    """Four blocks like the real ones (8x down: 64 px -> 8x8 latents). Flux's VAE has a shift and no quant convs."""
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        latent_channels=latent_channels,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=shift_factor is None,
        use_post_quant_conv=shift_factor is None,
    )


def _unet(cross_attention_dim: int, **extra: Any) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=(2, 4),
        **extra,
    )


def _sd(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = _clip_tokenizer(scratch / "tokenizer")
    width = unet.config.cross_attention_dim if unet is not None else 32
    return dict(
        vae=vae or _vae(4, 0.18215),
        text_encoder=_clip(tokenizer, width),
        tokenizer=tokenizer,
        unet=unet or _unet(width),
        scheduler=PNDMScheduler(**SD_BETAS, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sdxl(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    # Unequal widths (32 + 64) so a swapped or missing encoder shows in the shapes; tokenizer_2 pads with "!" as
    # SDXL's does, so lengths must come from the attention mask.
    tokenizer, tokenizer_2 = _clip_tokenizer(scratch / "tokenizer"), _clip_tokenizer(scratch / "tokenizer_2", "!")
    time_embed_dim = 8
    unet = unet or _unet(
        32 + 64,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + 64,  # 6 size/crop numbers + pooled
        use_linear_projection=True,
    )
    # the UNet reads both encoders' hidden states side by side, and the second one's pooled output
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
    return dict(
        vae=vae or _vae(4, 0.13025),
        text_encoder=_clip(tokenizer, unet.config.cross_attention_dim - pooled),
        text_encoder_2=_clip(tokenizer_2, pooled, projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading", steps_offset=1),
        add_watermarker=False,
    )


def _flux(scratch: Path, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer, tokenizer_2 = _clip_tokenizer(scratch / "tokenizer"), _t5_tokenizer(scratch / "tokenizer_2")
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=transformer.config.joint_attention_dim if transformer is not None else 48,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
        )
    )
    transformer = transformer or FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5.config.d_model,
        pooled_projection_dim=32,  # CLIP width
        guidance_embeds=True,  # like FLUX.1-dev
        axes_dims_rope=(4, 6, 6),
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae or _vae(16, 0.3611, shift_factor=0.1159),
        text_encoder=_clip(tokenizer, transformer.config.pooled_projection_dim),
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# Each family's pipeline class (it writes model_index.json) and the builder of its components.
_BUILDERS: dict[Family, tuple[type[DiffusionPipeline], Callable[..., dict[str, Any]]]] = {
    Family.SD: (StableDiffusionPipeline, _sd),
    Family.SDXL: (StableDiffusionXLPipeline, _sdxl),
    Family.FLUX: (FluxPipeline, _flux),
}


def build_tiny_model(family: Family, out_dir: str, seed: int = 0) -> str:
    """Write a tiny `family` pipeline with random weights (deterministic for a seed) into out_dir; returns out_dir.
    Leaves the caller's torch random state as it was."""
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(seed)
        pipeline_class, components = _BUILDERS[Family(family)]
        pipeline_class(**components(Path(scratch))).save_pretrained(out_dir)
    return out_dir


def build_published_model(
    name: str,
    out_dir: str,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    denoiser: dict[str, Any] | None = None,
    vae: dict[str, Any] | None = None,
) -> str:
    """Write a pipeline with `name`'s published denoiser and VAE (their configs changed by the `denoiser` and `vae`
    overrides: fewer blocks, say), random weights in `dtype` (built on `device`: a GPU draws billions of weights in
    seconds), and tiny text encoders of the widths the denoiser reads, into out_dir; returns out_dir."""
    family = PUBLISHED[name]
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(seed)
        denoiser_module = build_published(published_config(name, "denoiser", **(denoiser or {})), device).to(dtype)
        vae_module = build_published(published_config(name, "vae", **(vae or {})), device).to(dtype)
        pipeline_class, components = _BUILDERS[family]
        pipeline_class(**components(Path(scratch), denoiser_module, vae_module)).save_pretrained(out_dir)
    return out_dir
