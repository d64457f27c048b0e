"""What the export tests share: a denoiser's weights changed as training would change them, and the files of a
pipeline folder besides its denoiser's, to compare an export with its source."""

from __future__ import annotations

from pathlib import Path

import torch


def perturbed(denoiser: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The denoiser's state with every tensor moved a little (seeded): weights a run could have trained."""
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + 0.01 * torch.randn(v.shape, generator=g) for k, v in denoiser.state_dict().items()}


def files(root: Path, skip: str) -> list[str]:
    """Every file below `root` but those of its `skip` folder (the denoiser's), relative to `root`."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.parts[len(root.parts)] != skip)
