"""What the benchmarks need to know of each family's published denoiser, in one place: which config keys count its
blocks (so a model can be built at full width and reduced depth, and a measurement on it scaled back to full depth)
and the text it is conditioned on at 1024 px (so a training step can be fed without the text encoders).

bench/memory.py (--table) and bench/gpu.py (flux, families) read these; everything else about a family comes from
its spec (stk.models.families): how the denoiser is called, how its target is packed, its latent channels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stk.models.components import latent_channels
from stk.models.families import flux, flux2, sd3, spec_for
from stk.models.model_json import scale_factor_of
from stk.models.published import PUBLISHED, published_config
from stk.models.textmask import TEXT_MASK
from stk.train.batch import StepInputs

__all__ = ["DENOISERS", "TITLES", "Denoiser", "denoiser_of", "flow_configs", "full_depth", "reduced_depth"]

REFERENCE_RESOLUTION = 1024


@dataclass(frozen=True)
class Denoiser:
    """One family's denoiser as the benchmarks see it."""

    # config key of a block count -> the denoiser's attribute (a ModuleList) holding those blocks; blocks of other
    # lists (Z-Image's refiners) keep their published count
    blocks: dict[str, str]
    text_tokens: int  # text tokens per sample at 1024 px
    sequences: dict[str, str | int]  # each (tokens, width) text output -> its width: a config key or a number
    pooled: dict[str, str | int] = field(default_factory=dict)  # each (width,) text output -> its width
    # the fewest blocks per key that hold one block of each kind: SD3's last block differs from the others
    # (context_pre_only: no LoRA target to_add_out, say), so two
    measured_blocks: int = 1


FLUX_BLOCKS = {"num_layers": "transformer_blocks", "num_single_layers": "single_transformer_blocks"}
# FLUX.2 (dev and klein) keeps all 512 positions, padding included
FLUX2 = Denoiser(FLUX_BLOCKS, flux2.MAX_SEQUENCE_LENGTH, {"prompt_embeds": "joint_attention_dim"})
DENOISERS: dict[str, Denoiser] = {
    "sdxl": Denoiser({}, 77, {"prompt_embeds": "cross_attention_dim"}, {"pooled_prompt_embeds": 1280}),
    "flux": Denoiser(
        FLUX_BLOCKS, flux.T5_MAX_LENGTH, {"prompt_embeds": "joint_attention_dim"},
        {"pooled_prompt_embeds": "pooled_projection_dim"},
    ),
    # CLIP's 77 tokens joined with T5's; the last block is measured apart (SD3.5 Medium's two measured blocks both
    # have its dual attention, which 11 of its 24 blocks lack: its figures err high)
    "sd3": Denoiser(
        {"num_layers": "transformer_blocks"}, 77 + sd3.T5_MAX_LENGTH, {"prompt_embeds": "joint_attention_dim"},
        {"pooled_prompt_embeds": "pooled_projection_dim"}, measured_blocks=2,
    ),
    "chroma": Denoiser(FLUX_BLOCKS, flux.T5_MAX_LENGTH, {"prompt_embeds": "joint_attention_dim", TEXT_MASK: 1}),
    # Z-Image stores each caption's real tokens (up to 512): 128 is a caption of ~90 words in Qwen3's chat template
    "zimage": Denoiser({"n_layers": "layers"}, 128, {"prompt_embeds": "cap_feat_dim", TEXT_MASK: 1}),
    "flux2": FLUX2,
    "flux2-klein": FLUX2,
    # Qwen-Image stores each caption's real tokens (up to 1024), Z-Image's 128 likewise
    "qwenimage": Denoiser(
        {"num_layers": "transformer_blocks"}, 128, {"prompt_embeds": "joint_attention_dim", TEXT_MASK: 1}
    ),
}  # fmt: skip

# config -> how tables name it
TITLES = {"sdxl": "SDXL UNet", "flux-dev": "Flux.1-dev", "sd35-large": "SD3.5 Large", "sd35-medium": "SD3.5 Medium",
          "chroma1": "Chroma1", "zimage": "Z-Image", "flux2-dev": "FLUX.2-dev", "flux2-klein-4b": "FLUX.2-klein 4B",
          "flux2-klein-9b": "FLUX.2-klein 9B", "qwen-image": "Qwen-Image"}  # fmt: skip


def denoiser_of(config: str) -> Denoiser:
    family = PUBLISHED[config].value
    if family not in DENOISERS:
        raise SystemExit(f"bench/denoisers.py: no entry for family {family} (config {config}): add its block keys")
    return DENOISERS[family]


def flow_configs() -> list[str]:
    """The published configs of the flow families, FLUX.1-dev first, new ones joining as they are published."""
    flows = [name for name, family in PUBLISHED.items() if spec_for(family).flow]
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
    """The family's training forward as stk.train.objectives runs it, at a fixed noise level (flow: sigma 0.5;
    DDPM: timestep 500): the denoiser's prediction and the target of its MSE."""
    spec = spec_for(PUBLISHED[config])
    latents = inputs.latents
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2)).to(latents)  # its device too
    b = len(latents)
    if spec.flow:
        levels, noisy, target = (
            torch.full((b,), 0.5, dtype=latents.dtype, device=latents.device),
            (latents + noise) / 2,
            noise - latents,
        )
    else:
        levels, noisy, target = torch.full((b,), 500, device=latents.device), latents + noise, noise
    settings = Settings(vae_scale_factor(config))
    return spec.denoise(settings, model, noisy, levels, inputs), spec.pack(target)
