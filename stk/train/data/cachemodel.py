"""The cache belongs to its model: stk-train refuses a cache whose latents or text embeddings were
made by another VAE or other text encoders than --model's. A cache of the same family made with
other weights (another fine-tune, another release) trains without any error on inputs the model
never produces, so the family check alone is not enough.

stk-cache records its encoders' identity in the manifest (`Encoders.config()`: digests of each
component's config and of an evenly strided sample of its weights, the VAE's latent normalisation,
the tokenizers' vocabularies). The same identity is computed here from --model with the same code,
on rank 0 only, in the dtype the cache recorded (the digests are of the weights in that dtype).
That costs one load of the VAE on the CPU; the text encoders (up to 24B parameters) are not loaded:
their digests are read from their files (stk.models.weightfiles), a few kilobytes per tensor. A
cache recorded before the text encoders' digests were of their files has them loaded on the CPU
instead. `--force` skips the check.
"""

from __future__ import annotations

import gc

import torch

from stk.errors import InputError
from stk.log import get_logger
from stk.models.base import identity_differences
from stk.models.families import Family, spec_for
from stk.train.data.loader import CacheData
from stk.train.data.plan import TrainPlan
from stk.train.options import TrainOptions

__all__ = ["check_cache_model", "latents_note", "note_latents"]

log = get_logger("train")


def check_cache_model(opts: TrainOptions, plan: TrainPlan) -> None:
    """Raise InputError (exit 3) naming each component whose identity differs; nothing to do when
    training from images, or with --force."""
    if not isinstance(plan.data, CacheData):
        return
    if opts.force:
        log.warning(
            "--force: not checking that %s was made with the VAE and text encoders of %s", opts.cache, opts.model
        )
        return
    recorded = plan.data.config.model
    dtype = getattr(torch, str(recorded.get("vae", {}).get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(
            f"{opts.cache}/manifest.json does not record the VAE and text encoders it was made with: "
            "cache again with this stk-cache, or pass --force to train on it anyway"
        )
    from stk.models import load_encoders

    # the meta device: the text encoders' identity without their weights (stk.models.components.load_text_encoder)
    of_files = all("weights_files_sha256" in e for e in recorded.get("text", {}).get("encoders", []))
    encoders = load_encoders(opts.model, plan.family, device="meta" if of_files else "cpu", dtype=dtype)
    current = encoders.config()
    del encoders
    gc.collect()
    differences = identity_differences(recorded, current)
    if differences:
        raise InputError(
            f"{opts.cache} was made with other model components than {opts.model} ({'; '.join(differences)}): "
            "cache with the model you train, or pass --force to train on this cache anyway"
        )


def note_latents(opts: TrainOptions, plan: TrainPlan) -> None:
    """The one line of `latents_note` for a run on a cache."""
    if isinstance(plan.data, CacheData):
        note = latents_note(plan.family, bool(plan.data.config.settings.store_logvar), opts.cache or "the cache")
        if note is not None:
            log.warning(note)


def latents_note(family: Family, stored_logvar: bool, cache: str) -> str | None:
    """What to tell a user whose cache holds the latents otherwise than `family`'s training example uses them (made
    with `stk-cache --latents` given), so that a run compared with the example says why it differs; None where not."""
    example = spec_for(family).denoiser.example
    if stored_logvar == example.samples_latents:
        return None
    script = example.script.rsplit("/", 1)[-1]
    if stored_logvar:
        return (
            f"{cache} was cached with mean and log-variance: this run trains on samples, where {script} trains on "
            "the mean (stk-cache --latents mean)"
        )
    return (
        f"{cache} was cached with the latent mean only: this run trains on it, where {script} trains on samples "
        "(stk-cache --latents params)"
    )
