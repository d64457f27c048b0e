"""Training micro-batches shaped for the tiny models (stk.models.tiny), and a stand-in engine that records calls."""

from __future__ import annotations

from typing import Any

import torch

from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.models.textmask import TEXT_MASK
from stk.train.data.batch import Batch


def cached_batch(keys: list[str], seed: int) -> Batch:
    """A cached micro-batch of the tiny SD model: a latent distribution (mean, logvar) and text embeddings."""
    g = torch.Generator().manual_seed(seed)
    tiny = spec_for(Family.SD).tiny
    size = (len(keys), tiny.latent_channels, 8, 8)
    return Batch(
        keys=keys,
        original_size=torch.tensor([[64, 64]] * len(keys)),
        crop_top_left=torch.zeros(len(keys), 2, dtype=torch.int64),
        mean=torch.randn(size, generator=g),
        logvar=torch.randn(size, generator=g) - 3,
        text={name: torch.randn(len(keys), *shape, generator=g) for name, shape in tiny.text.items()},
    )


def step_inputs(family: Family, size: tuple[int, int] = (8, 8), batch: int = 2, seed: int = 0) -> StepInputs:
    """A random training micro-batch shaped for the tiny model of `family` (its spec's `tiny`)."""
    g = torch.Generator().manual_seed(seed)
    tiny = spec_for(family).tiny
    return StepInputs(
        latents=torch.randn(batch, tiny.latent_channels, *size, generator=g),
        text={
            name: torch.ones(batch, *shape) if name == TEXT_MASK else torch.randn(batch, *shape, generator=g)
            for name, shape in tiny.text.items()
        },
        original_size=torch.tensor([[100, 120], [64, 80]])[:batch],
        crop_top_left=torch.tensor([[3, 5], [0, 7]])[:batch],
    )


class Recorder(torch.nn.Module):
    """Stands in for a DeepSpeed engine (the model as `.module`, no `.config` of its own) and records each call."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        self.calls.append((args, kwargs, output[0]))
        return output
