"""What a model family is to stk: one `FamilySpec` per family, in its module (stk/models/families/<name>.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

# Deep import where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

if TYPE_CHECKING:
    from stk.models.base import Encoders
    from stk.models.families.registry import Family
    from stk.models.layouts import KohyaLora
    from stk.train.batch import StepInputs

__all__ = [
    "Denoise",
    "DenoiseSettings",
    "Example",
    "FamilySpec",
    "SampleInputs",
    "Sampling",
    "SingleFile",
    "TinyBuilder",
    "as_given",
    "config_mu",
    "unpacked",
]


class DenoiseSettings(Protocol):
    """What a family's forward pass reads of the objective that calls it (stk.train.objectives.Objective)."""

    @property
    def guidance_scale(self) -> float:
        """Guidance-distilled models (FLUX.1-dev) take it as an input."""

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent, for size conditioning."""


# The family's training forward pass, as its pipeline calls the denoiser: (the objective's settings, denoiser or a
# DeepSpeed engine around it, noisy latents (B, C, h, w), timesteps (DDPM) or sigmas (flow), inputs) -> the prediction.
Denoise = Callable[[DenoiseSettings, torch.nn.Module, torch.Tensor, torch.Tensor, "StepInputs"], torch.Tensor]
# (scratch folder for tokenizer files, a denoiser module or None, a VAE module or None) -> the pipeline's components,
# tiny random-weight ones where None is given.
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


@dataclass(frozen=True)
class Sampling:
    """How the family's pipeline is usually run, for the sample images of a run."""

    steps: int
    guidance: float
    negative_prompt: bool  # classifier-free guidance with the empty caption as the negative prompt


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
class Example:
    """What the family's diffusers training example does by default, where stk's defaults follow it: the script
    (in diffusers' repository), its `--weighting_scheme` as stk's `--timestep-sampling`, and whether it trains on a
    sample of the VAE's latent distribution (`latent_dist.sample()`) or its mode (`.mode()`)."""

    script: str
    timestep_sampling: str = "uniform"  # flow families: "uniform" (the scripts' "none") or "logit-normal"
    samples_latents: bool = True


@dataclass(frozen=True)
class FamilySpec:
    name: Family
    title: str  # how messages name the family: "SDXL"
    pipelines: tuple[str, ...]  # the model_index.json `_class_name`s of this family (detection)
    pipeline_class: type[Any]  # writes model_index.json, saves the LoRA file, makes the sample images
    encoders: type[Encoders]  # the VAE and the text recipe of the pipeline's own encode_prompt
    denoiser_subfolder: str  # "unet" or "transformer"
    denoiser_class: type[Any]  # a diffusers ModelMixin (and ConfigMixin)
    flow: bool  # flow matching (sigmas, target noise - latents); else DDPM (timesteps, epsilon or v)
    denoise: Denoise
    lora_targets: tuple[str, ...]  # the default --lora-targets, as diffusers' training examples adapt the family
    sampling: Sampling
    example: Example  # the diffusers training example whose defaults stk-cache's and stk-train's are
    published: tuple[str, ...]  # configs in stk/models/configs/<name>/ of the published architectures
    tiny: TinyBuilder
    patch_size: int = 1  # latent patches per side that the denoiser takes as one token
    pack: Callable[[torch.Tensor], torch.Tensor] = unpacked  # a (B, C, h, w) target in the prediction's layout
    sample_inputs: SampleInputs = as_given  # how the pipeline takes embeddings for the sample images
    vae_class: type[Any] = AutoencoderKL  # the diffusers class of the pipeline's vae/
    # flow families: the loss compares noisy - sigma * prediction with the clean latents (EDM's preconditioning, the
    # velocity MSE weighted by sigma^2), as diffusers' SD3 examples do by default (--precondition_outputs 1)
    precondition_outputs: bool = False
    # flow families whose scheduler shifts dynamically: the mu the pipeline passes it for an image of N tokens
    # (`--flow-shift auto`), from the scheduler config and N
    inference_mu: Callable[[Mapping[str, Any], int], float] = config_mu
    guidance_argument: str = "guidance_scale"  # the pipeline's call argument that takes `Sampling.guidance`
    # stk-train may load the text encoders (for prompts the cache lacks, and --vae-on-the-fly); False where they are an
    # LLM of billions of parameters, which only stk-cache loads: the cache must hold every caption and prompt
    text_encoders_in_train: bool = True
    # stk-export: a LoRA under kohya/ComfyUI's names (None: the family has none), and the whole fine-tuned model as one
    # file in the original layout (None where diffusers' from_single_file cannot read one back)
    kohya_lora: KohyaLora | None = None
    single_file: SingleFile | None = None
    single_file_class: str = ""  # the diffusers class whose from_single_file reads it back (for the docs and tests)

    def alignment(self, vae_scale_factor: int) -> int:
        """Pixels that an image's sides must be multiples of, for a VAE of `vae_scale_factor`."""
        return vae_scale_factor * self.patch_size
