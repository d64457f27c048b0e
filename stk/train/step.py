"""One optimizer step on one rank: `train_step` runs its micro-batches through the objective on the DeepSpeed engine.

It knows nothing of ranks beyond its own place in the step, of checkpoints or of stop signals, so a test can run it
in-process on an engine of one rank. Every random draw of a micro-batch comes from a generator that is a pure
function of the seed, the optimizer step and the micro-batch's place in it (`step_generator`): a resumed run draws
exactly what an uninterrupted one would, on any number of ranks that keeps the batch size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from stk.models.interface import StepInputs
from stk.models.latents import LatentNorm
from stk.train.data.batch import Batch, collate_text
from stk.train.objective.losses import drop_captions
from stk.train.objective.objectives import Objective

__all__ = ["StepModel", "StepResult", "batch_digest", "step_generator", "step_inputs", "train_step"]


@dataclass
class StepModel:
    """What a micro-step runs: the objective on the engine, inputs moved to the device and dtype."""

    objective: Objective
    engine: Any
    encoders: Any  # stk.models.Encoders with --vae-on-the-fly, else None
    device: torch.device
    dtype: torch.dtype
    norm: LatentNorm  # the VAE's latent normalisation
    empty_caption: dict[str, torch.Tensor] | None = None  # its embedding, with --caption-dropout
    caption_dropout: float = 0.0
    dataset_dropout: dict[str, float] = field(default_factory=dict)  # a dataset's own, in place of caption_dropout

    def dropout_of(self, dataset: str) -> float:
        """The caption dropout of a dataset's samples: its own, else --caption-dropout."""
        return self.dataset_dropout.get(dataset, self.caption_dropout)


@dataclass
class StepResult:
    """This rank's share of an optimizer step."""

    loss: float  # the mean of its micro-batches' losses
    digest: int  # the sum of their batch_digest values
    micro_batches: int
    dataset: str = ""  # the one its samples came from ("" in a run of one dataset)


def train_step(
    model: StepModel,
    batches: Iterator[Batch],
    step: int,
    seed: int,
    rank: int,
    world_size: int,
    accum: int,
    dataset: str = "",
) -> StepResult | None:
    """Optimizer step `step + 1` on this rank: `accum` micro-batches from `batches` (of `dataset`), each forward,
    backward and `engine.step()` (DeepSpeed steps the optimizer after the last). None when `batches` ends first (the
    epoch's end: the sampler cuts an epoch into whole optimizer steps)."""
    loss_sum, digest = 0.0, 0
    for micro in range(accum):
        batch = next(batches, None)
        if batch is None:
            return None
        slot = micro * world_size + rank  # this micro-batch's place in the optimizer step
        generator = step_generator(seed, step, slot)
        loss = model.objective.loss(model.engine, step_inputs(batch, model, generator, dataset), generator)
        model.engine.backward(loss)
        model.engine.step()
        loss_sum += float(loss.detach())
        digest += batch_digest(slot, batch.keys)
    return StepResult(loss_sum / accum, digest, accum, dataset)


def step_generator(seed: int, step: int, slot: int) -> torch.Generator:
    """The noise, timesteps and latent samples of one micro-batch: a pure function of the seed, the optimizer step
    and the micro-batch's place in it (micro-step x ranks + rank, the order the sampler cuts the step in), so a
    resumed run draws exactly what an uninterrupted one would, on any number of ranks that keeps the batch size."""
    digest = hashlib.sha256(f"stk-train:{seed}:{step}:{slot}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def batch_digest(slot: int, keys: list[str]) -> int:
    """32 bits of a micro-batch's sample keys and its place in the optimizer step; summed over the step's
    micro-batches (agree), metrics.jsonl's `batch_digest` shows that a resumed run, on any number of ranks, trained
    each step on what an uninterrupted one did."""
    return int.from_bytes(hashlib.sha256(f"{slot}:{chr(0).join(keys)}".encode()).digest()[:4], "little")


def step_inputs(batch: Batch, model: StepModel, generator: torch.Generator, dataset: str = "") -> StepInputs:
    """Latents sampled and normalised for the denoiser, from cached ones or encoded now; captions dropped at the
    rate of the batch's dataset."""
    if batch.pixels is not None:
        assert model.encoders is not None and batch.captions is not None
        mean, logvar = model.encoders.encode_images(batch.pixels)
        if not model.objective.spec.denoiser.example.samples_latents:  # the example trains on the mode
            logvar = None
        embeds = model.encoders.encode_text(batch.captions)
        text = collate_text([e.arrays for e in embeds])
    else:  # the cache holds the log-variance where the family's example samples (stk-cache --latents)
        assert batch.mean is not None and batch.text is not None
        mean, logvar, text = batch.mean, batch.logvar, batch.text
    latent = mean
    if logvar is not None:  # a fresh sample of the latent distribution each time the image is seen
        latent = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=generator)
    if model.empty_caption is not None:
        text = drop_captions(text, model.empty_caption, model.dropout_of(dataset), generator)
    return StepInputs(
        latents=model.norm.normalize(latent).to(model.device, model.dtype),
        text={name: value.to(model.device, model.dtype) for name, value in text.items()},
        original_size=batch.original_size.to(model.device),
        crop_top_left=batch.crop_top_left.to(model.device),
    )
