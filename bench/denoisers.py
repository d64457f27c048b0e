"""A family's published denoiser as the benchmarks build and feed it, from its spec (stk.models.families): which config
keys count its blocks (so a model can be built at full width and reduced depth, and a measurement on it scaled back to
full depth), the text it is conditioned on at 1024 px (so a training step can be fed without the text encoders), and
its training forward. bench/memory.py (--table), bench/projection.py and bench/gpu.py read these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stk.models.components import latent_channels
from stk.models.families import all_specs, spec_for
from stk.models.interface import StepInputs
from stk.models.model_json import scale_factor_of
from stk.models.published import PUBLISHED, published_config
from stk.models.textmask import TEXT_MASK

__all__ = ["TITLES", "Denoiser", "denoiser_of", "flow_configs", "full_depth", "reduced_depth"]

REFERENCE_RESOLUTION = 1024


@dataclass(frozen=True)
class Denoiser:
    """One family's denoiser as the benchmarks see it, from its spec (`FamilySpec.denoiser` and `.text`)."""

    blocks: Mapping[str, str]  # config key of a block count -> the denoiser's ModuleList of those blocks
    text_tokens: int  # text tokens per sample at 1024 px
    sequences: Mapping[str, str | int]  # each (tokens, width) text output -> its width: a config key or a number
    pooled: Mapping[str, str | int]  # each (width,) text output -> its width
    measured_blocks: int  # the fewest blocks per key that hold one block of each kind


# config -> how tables name it (`FamilySpec.published`)
TITLES = {name: title for spec in all_specs() for name, title in spec.published.items()}


def denoiser_of(config: str) -> Denoiser:
    spec = spec_for(PUBLISHED[config])
    return Denoiser(
        spec.denoiser.blocks, spec.text.tokens, spec.text.sequences, spec.text.pooled, spec.denoiser.measured_blocks
    )


def flow_configs() -> list[str]:
    """The published configs of the flow families, FLUX.1-dev first, new ones joining as they are published."""
    flows = [name for name, family in PUBLISHED.items() if spec_for(family).denoiser.flow]
    return sorted(flows, key=lambda name: name != "flux-dev")


def full_depth(config: str) -> dict[str, int]:
    """The published block counts, by config key."""
    published = published_config(config, "denoiser")
    return {key: int(published[key]) for key in denoiser_of(config).blocks}


def reduced_depth(config: str, blocks: int | None = None) -> dict[str, int]:
    """Config overrides with `blocks` blocks per block-count key, and never fewer than the measured count."""
    d = denoiser_of(config)
    return {key: max(blocks or 0, d.measured_blocks) for key in d.blocks}


def text_inputs(config: str, denoiser_config: dict[str, Any], tokens: int, batch: int, g: torch.Generator):
    """Random text embeddings shaped as the family's cache stores them (a text mask of ones: every token real)."""
    d = denoiser_of(config)

    def width(w: str | int) -> int:
        return int(denoiser_config[w]) if isinstance(w, str) else w

    text = {name: torch.randn(batch, tokens, width(w), generator=g) for name, w in d.sequences.items()}
    text.update({name: torch.randn(batch, width(w), generator=g) for name, w in d.pooled.items()})
    if TEXT_MASK in text:
        text[TEXT_MASK] = torch.ones_like(text[TEXT_MASK])
    return text


@dataclass(frozen=True)
class Settings:
    """What a family's denoise reads of stk's objective (stk.models.families.spec.DenoiseSettings)."""

    vae_scale_factor: int
    guidance_scale: float = 3.5  # stk-train's default


def vae_scale_factor(config: str) -> int:
    """Pixels per latent of the published VAE (as diffusers' pipelines compute it)."""
    return scale_factor_of(published_config(config, "vae"))


def step_inputs(
    config: str, denoiser_config: dict[str, Any], resolution: int, tokens: int, dtype: torch.dtype
) -> StepInputs:
    """A batch of one at `resolution` px as stk-train hands it to the family's denoise: latents and text."""
    g = torch.Generator().manual_seed(1)
    channels = latent_channels(published_config(config, "vae"))
    side = resolution // vae_scale_factor(config)
    text = text_inputs(config, denoiser_config, tokens, 1, g)
    return StepInputs(
        latents=torch.randn(1, channels, side, side, generator=g).to(dtype),
        text={name: value.to(dtype) for name, value in text.items()},
        original_size=torch.tensor([[resolution, resolution]]),
        crop_top_left=torch.tensor([[0, 0]]),
    )


def training_forward(config: str, model: torch.nn.Module, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's training forward as stk.train.objective.objectives runs it, at a fixed noise level (flow: sigma 0.5;
    DDPM: timestep 500): the denoiser's prediction and the target of its MSE."""
    spec = spec_for(PUBLISHED[config])
    latents = inputs.latents
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2)).to(latents)  # its device too
    b = len(latents)
    if spec.denoiser.flow:
        levels, noisy, target = (
            torch.full((b,), 0.5, dtype=latents.dtype, device=latents.device),
            (latents + noise) / 2,
            noise - latents,
        )
    else:
        levels, noisy, target = torch.full((b,), 500, device=latents.device), latents + noise, noise
    settings = Settings(vae_scale_factor(config))
    return spec.denoiser.denoise(settings, model, noisy, levels, inputs), spec.latents.pack(target)
