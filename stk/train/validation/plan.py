"""What validation images a run makes and when: the --validation-* options, settled before any model loads.

Images are made at step 0 (the baseline, when a run starts from scratch), every `every` optimizer
steps, and after the last step, for each prompt: from --validation-prompt / --validation-prompts,
else the prompts the cache holds (`stk-cache --validation-prompts`). stk.train.validation.render makes them, for
stk.train.validation.validator, which decides when.
"""

from __future__ import annotations

from dataclasses import dataclass

from stk.errors import InputError
from stk.models.alignment import check_aligned
from stk.models.families import Family, spec_for
from stk.prompts import read_prompts

__all__ = ["ValidationPlan", "ValidationSettings", "parse_resolution", "plan_validation"]


@dataclass(frozen=True)
class ValidationSettings:
    prompts: tuple[str, ...] = ()  # --validation-prompt, in order
    prompts_file: str | None = None  # --validation-prompts: one per line, after `prompts`
    every: int = 500  # optimizer steps between rounds; 0: only at step 0 and the end
    steps: int | None = None  # inference steps; None: the family's
    guidance: float | None = None  # None: the family's
    resolution: tuple[int, int] | None = None  # (width, height); None: the run's most common bucket
    seed: int = 0
    enabled: bool = True  # --no-validation: none, whatever the cache holds


@dataclass(frozen=True)
class ValidationPlan:
    prompts: tuple[str, ...]
    every: int
    steps: int
    guidance: float
    width: int
    height: int
    seed: int

    def due(self, step: int, last: int) -> bool:
        """Whether a round follows optimizer step `step` of a run of `last` steps."""
        return step >= last or (self.every > 0 and step % self.every == 0)


def parse_resolution(text: str) -> tuple[int, int]:
    """'1024x768' (width x height) or '1024' (square) -> (width, height)."""
    parts = text.lower().split("x")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        width, height = int(parts[0]), int(parts[-1])
    except ValueError:
        raise InputError(f"--validation-resolution {text!r}: give WIDTHxHEIGHT, like 1024x768, or one side") from None
    if width <= 0 or height <= 0:
        raise InputError(f"--validation-resolution {text!r}: both sides must be positive")
    return width, height


def plan_validation(
    settings: ValidationSettings,
    family: Family,
    cached_prompts: list[str],
    buckets: dict[tuple[int, int], int],  # latent (h, w) -> samples per epoch
    vae_scale_factor: int,
) -> ValidationPlan | None:
    """The images to make, or None for none; refuses an empty prompt file and a resolution the family's pipeline
    cannot make (its sides are multiples of the VAE's factor times the denoiser's patch: `LatentSpec.alignment`)."""
    prompts = list(settings.prompts)
    if settings.prompts_file:
        prompts += read_prompts(settings.prompts_file)
    if not prompts:
        prompts = list(cached_prompts)
    if not settings.enabled or not prompts:
        return None
    spec = spec_for(family)
    steps, guidance = spec.sampling.steps, spec.sampling.guidance
    if settings.resolution is not None:
        width, height = settings.resolution
    else:
        latent_h, latent_w = max(buckets, key=lambda hw: (buckets[hw], hw))
        width, height = latent_w * vae_scale_factor, latent_h * vae_scale_factor
    alignment = spec.latents.alignment(vae_scale_factor)
    check_aligned([(width, height)], alignment, family, "--validation-resolution", "give one of those")
    return ValidationPlan(
        prompts=tuple(prompts),
        every=settings.every,
        steps=settings.steps or steps,
        guidance=guidance if settings.guidance is None else settings.guidance,
        width=width,
        height=height,
        seed=settings.seed,
    )
