"""The image sides a family trains on and samples at: multiples of its VAE's scale factor times its patch size
(16 px for the flow transformers that pack 2x2 latent patches, 8 px for SD and SDXL). stk-scan --family defaults
to it, and stk-cache and stk-train's sample images refuse other sizes, naming the nearest valid ones."""

from __future__ import annotations

from collections.abc import Iterable

from stk.buckets import nearest_aligned, nearest_multiples
from stk.errors import InputError
from stk.models.families import Family, spec_for
from stk.models.model_json import scale_factor_of, vae_scale_factor
from stk.models.published import published_config

__all__ = ["check_aligned", "family_alignment", "model_alignment", "scan_alignment"]


def family_alignment(family: Family) -> int:
    """The alignment of `family`'s published models (their VAE's scale factor), when no model is given."""
    spec = spec_for(family)
    return spec.latents.alignment(scale_factor_of(published_config(next(iter(spec.published)), "vae")))


def model_alignment(model: str, family: Family) -> int:
    """The alignment of `model`, read from its VAE config (no weights)."""
    return spec_for(family).latents.alignment(vae_scale_factor(model))


def check_aligned(sizes: Iterable[tuple[int, int]], alignment: int, family: Family, what: str, fix: str) -> None:
    """Refuse `what` (e.g. "bucket") sizes (width, height) whose sides are not multiples of `alignment`, naming the
    first one's nearest valid sizes and `fix`."""
    bad = sorted({(w, h) for w, h in sizes if w % alignment or h % alignment})
    if not bad:
        return
    (width, height), more = bad[0], f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise InputError(
        f"{what} {width}x{height}{more}: {spec_for(family).title} needs sides that are multiples of {alignment}, "
        f"nearest {nearest_aligned(width, height, alignment)}; {fix}"
    )


def scan_alignment(given: int | None, family: Family) -> int:
    """stk-scan's bucket alignment for `family`: `given`, else the family's. A given one that is not a multiple of
    the family's is refused, naming the nearest that are."""
    needed = family_alignment(family)
    if given is None:
        return needed
    if given % needed:
        below, above = nearest_multiples(given, needed)
        raise InputError(
            f"--alignment {given}: {spec_for(family).title} needs bucket sides that are multiples of {needed}; "
            f"use {below} or {above}"
        )
    return given
