"""What the data side hands the training step: one rank's micro-batch, from the cache or from images.

A cached batch carries latents and text embeddings; a `--vae-on-the-fly` batch carries pixels and
captions, which the step encodes with the frozen VAE and text encoders. Either way the step ends up
with the same `StepInputs`, so every family's objective sees one shape of input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["Batch", "collate_text", "stack_float32"]


@dataclass
class Batch:
    """One rank's micro-batch; all samples share one bucket (one latent shape).

    From the cache: `mean` (and `logvar` when the cache stores distribution parameters) are the VAE's
    latent distribution, unscaled and unshifted, float32 (B, C, h, w); `text` holds the caption
    embeddings as float32, sequences (B, L, D) zero-padded to the batch's longest, pooled (B, D).
    From images (--vae-on-the-fly): `pixels` (B, 3, H, W) in [-1, 1] and `captions` instead.
    `original_size` and `crop_top_left` are (B, 2) int64, (height, width) and (top, left): SDXL's
    added conditioning.
    """

    keys: list[str]
    original_size: torch.Tensor
    crop_top_left: torch.Tensor
    mean: torch.Tensor | None = None
    logvar: torch.Tensor | None = None
    text: dict[str, torch.Tensor] | None = None
    pixels: torch.Tensor | None = None
    captions: list[str] | None = None

    def __len__(self) -> int:
        return len(self.keys)


def stack_float32(arrays: list[np.ndarray]) -> torch.Tensor:
    """(B, ...) float32 from same-shaped arrays (float16 as stored), converted while copied."""
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) != 1:
        raise ValueError(f"a batch holds one latent shape (one bucket), got {shapes}")
    out = np.empty((len(arrays), *shapes[0]), dtype=np.float32)
    for i, array in enumerate(arrays):
        out[i] = array
    return torch.from_numpy(out)


def collate_text(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Each caption's arrays batched as float32: sequences (L, D) zero-padded to the batch's longest (a
    --trim-padding cache, and a family that masks padding, store only the real tokens), pooled vectors (D,) stacked."""
    out: dict[str, torch.Tensor] = {}
    for name, first in samples[0].items():
        arrays = [s[name] for s in samples]
        if first.ndim == 2:
            widths = {a.shape[1] for a in arrays}
            if len(widths) != 1:
                raise ValueError(f"text array {name}: widths {sorted(widths)} differ within one batch")
            # padded as stored (float16: half the bytes to copy), then converted once
            out[name] = pad_sequence([torch.from_numpy(a) for a in arrays], batch_first=True).float()
        else:
            out[name] = stack_float32(arrays)
    return out
