"""What a model family is to stk: one `FamilySpec` per family, named SPEC in its folder's `__init__.py`
(stk/models/families/<name>/), made of a few parts: its text, its latents, its denoiser and objective, its samples,
its export and its tiny model. Where families behave differently a part holds a function, written in the family's
folder, so a new quirk is code there, not a new field and an edit under stk/train."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Deep import where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from stk.models.interface import DenoiseSettings, StepInputs

if TYPE_CHECKING:
    from stk.models.base import Encoders
    from stk.models.families.registry import Family
    from stk.models.layouts import KohyaLora

__all__ = [
    "Denoise",
    "DenoiserSpec",
    "Example",
    "ExportSpec",
    "FamilySpec",
    "LatentSpec",
    "SampleInputs",
    "SamplingSpec",
    "SingleFile",
    "TextSpec",
    "TinyBuilder",
    "TinySpec",
    "all_reached",
    "as_given",
    "config_mu",
    "unpacked",
]

# The family's training forward pass, as its pipeline calls the denoiser: (the objective's settings, denoiser or a
# DeepSpeed engine around it, noisy latents (B, C, h, w), timesteps (DDPM) or sigmas (flow), inputs) -> the prediction.
Denoise = Callable[[DenoiseSettings, torch.nn.Module, torch.Tensor, torch.Tensor, StepInputs], torch.Tensor]
# (scratch folder for tokenizer files, a denoiser module or None, a VAE module or None) -> the pipeline's components,
# tiny random-weight ones where None is given: `build` in the family's tiny.py.
TinyBuilder = Callable[[Path, Any, Any], dict[str, Any]]
# A saved pipeline's folder -> its weights as one state dict in the model's original layout (stk-export).
SingleFile = Callable[[Path], dict[str, torch.Tensor]]
# One sample image's embeddings (batch 1; the negative prompt's prefixed `negative_`) -> the pipeline's call arguments.
SampleInputs = Callable[[dict[str, torch.Tensor]], dict[str, Any]]


def as_given(embeddings: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Pipelines that take the stored embeddings under their own names (prompt_embeds, pooled_prompt_embeds)."""
    return embeddings


def unpacked(latents: torch.Tensor) -> torch.Tensor:
    """The target of a denoiser that predicts in the latents' own layout."""
    return latents


def all_reached(denoiser: torch.nn.Module) -> set[str]:
    """A denoiser whose every parameter the training forward reaches."""
    return set()


def config_mu(config: Mapping[str, Any], image_seq_len: int) -> float:
    """The resolution-dependent shift (mu) that FLUX.1's pipeline (and Chroma's, Qwen-Image's, Z-Image's) passes its
    dynamically shifting scheduler: a line through the config's base and max shifts."""
    return float(
        calculate_shift(
            image_seq_len,
            config["base_image_seq_len"],
            config["max_image_seq_len"],
            config["base_shift"],
            config["max_shift"],
        )
    )


@dataclass(frozen=True)
class TextSpec:
    """The text the denoiser is conditioned on: the encoders (the pipeline's own encode_prompt) and what the
    benchmarks need to feed a step without them."""

    encoders: type[Encoders]  # the VAE and the text recipe of the pipeline's own encode_prompt
    # each (tokens, width) output's width, as a key of the denoiser's config or a number (benchmarks, tests)
    sequences: Mapping[str, str | int]
    pooled: Mapping[str, str | int] = field(default_factory=dict)  # each (width,) output's width, likewise
    tokens: int = 77  # text tokens per sample at 1024 px, as the cache holds them (benchmarks)
    # stk-train may load the text encoders (for prompts the cache lacks, and --vae-on-the-fly); False where they are an
    # LLM of billions of parameters, which only stk-cache loads: the cache must hold every caption and prompt
    in_train: bool = True


@dataclass(frozen=True)
class LatentSpec:
    """The VAE's latents as the denoiser takes them."""

    vae_class: type[Any] = AutoencoderKL  # the diffusers class of the pipeline's vae/
    patch_size: int = 1  # latent patches per side that the denoiser takes as one token
    pack: Callable[[torch.Tensor], torch.Tensor] = unpacked  # a (B, C, h, w) target in the prediction's layout

    def alignment(self, vae_scale_factor: int) -> int:
        """Pixels that an image's sides must be multiples of, for a VAE of `vae_scale_factor`."""
        return vae_scale_factor * self.patch_size


@dataclass(frozen=True)
class Example:
    """What the family's diffusers training example does by default, where stk's defaults follow it: the script
    (in diffusers' repository), its `--weighting_scheme` as stk's `--timestep-sampling`, and whether it trains on a
    sample of the VAE's latent distribution (`latent_dist.sample()`) or its mode (`.mode()`)."""

    script: str
    timestep_sampling: str = "uniform"  # flow families: "uniform" (the scripts' "none") or "logit-normal"
    samples_latents: bool = True


@dataclass(frozen=True)
class DenoiserSpec:
    """The denoiser and the objective it trains by: how it is loaded and called, what an adapter wraps by default,
    and which diffusers example's defaults the objective follows."""

    subfolder: str  # "unet" or "transformer"
    model_class: type[Any]  # a diffusers ModelMixin (and ConfigMixin)
    flow: bool  # flow matching (sigmas, target noise - latents); else DDPM (timesteps, epsilon or v)
    denoise: Denoise
    lora_targets: tuple[str, ...]  # the default --lora-targets, as diffusers' training examples adapt the family
    example: Example  # the diffusers training example whose defaults stk-cache's and stk-train's are
    # flow families: the loss compares noisy - sigma * prediction with the clean latents (EDM's preconditioning, the
    # velocity MSE weighted by sigma^2), as diffusers' SD3 examples do by default (--precondition_outputs 1)
    precondition_outputs: bool = False
    # flow families whose scheduler shifts dynamically: the mu the pipeline passes it for an image of N tokens
    # (`--flow-shift auto`), from the scheduler config and N
    inference_mu: Callable[[Mapping[str, Any], int], float] = config_mu
    # benchmarks: config key of a block count -> the denoiser's attribute (a ModuleList) holding those blocks, so a
    # model can be built at full width and reduced depth and a measurement scaled back; other lists keep their count
    blocks: Mapping[str, str] = field(default_factory=dict)
    # the fewest blocks per key that hold one block of each kind (SD3's last block differs from the others)
    measured_blocks: int = 1
    # the denoiser's parameters that no training forward reaches, so that get no gradient (the model has them)
    unreached: Callable[[torch.nn.Module], set[str]] = all_reached


@dataclass(frozen=True)
class SamplingSpec:
    """How the family's pipeline is usually run, for the sample images of a run."""

    steps: int
    guidance: float
    negative_prompt: bool  # classifier-free guidance with the empty caption as the negative prompt
    inputs: SampleInputs = as_given  # how the pipeline takes embeddings for the sample images
    guidance_argument: str = "guidance_scale"  # the pipeline's call argument that takes `guidance`


@dataclass(frozen=True)
class ExportSpec:
    """stk-export: a LoRA under kohya/ComfyUI's names (None: the family has none), and the whole fine-tuned model as
    one file in the original layout (None where diffusers' from_single_file cannot read one back)."""

    kohya_lora: KohyaLora | None = None
    single_file: SingleFile | None = None
    single_file_class: str = ""  # the diffusers class whose from_single_file reads it back (for the docs and tests)


@dataclass(frozen=True)
class TinySpec:
    """The family's tiny random-weight model (built by `build` in its tiny.py) as tests feed it: per-sample text
    shapes of a training step, the latent channels, and the latents its pipeline returns for one 64 px image."""

    text: Mapping[str, tuple[int, ...]]
    latent_channels: int
    pipeline_latents: tuple[int, ...]  # `output_type="latent"`: packed tokens for the families that pack


@dataclass(frozen=True)
class FamilySpec:
    name: Family  # from the folder: `family_of(__name__)`
    title: str  # how messages name the family: "SDXL"
    pipelines: tuple[str, ...]  # the model_index.json `_class_name`s of this family (detection)
    pipeline_class: type[Any]  # writes model_index.json, saves the LoRA file, makes the sample images
    published: Mapping[str, str]  # config folder in the family's configs/ -> how tables name it
    text: TextSpec
    latents: LatentSpec
    denoiser: DenoiserSpec
    sampling: SamplingSpec
    tiny: TinySpec
    export: ExportSpec = ExportSpec()
