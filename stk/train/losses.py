"""The loss options people tune, each from its published formula; the defaults are plain MSE and today's Flux
schedule, so a run without them trains exactly as before.

- min-SNR-gamma weighting (Hang et al. 2023, as diffusers' train_text_to_image.py applies it): a sample at
  timestep t weighs min(SNR(t), gamma) / SNR(t) for epsilon prediction, min(SNR(t), gamma) / (SNR(t) + 1) for
  v prediction. DDPM families (SD, SDXL).
- noise offset (crosslabs 2023): noise + offset * N(0, 1) drawn once per image and channel, so the model can
  learn to shift an image's mean brightness. DDPM families.
- caption dropout (as diffusers' examples' --proportion_empty_prompts): each sample's caption embedding is the
  empty caption's with probability P, so the model also learns the unconditional prediction that classifier-free
  guidance subtracts. Every family.
- the flow families' timestep sampling (Flux's): logit-normal sigmoid(N(mean, std)) (stk's default; the default
  of diffusers' SD3 scripts, `--weighting_scheme logit_normal`), sigmoid sigmoid(std * N(0, 1)) (kohya's,
  logit-normal centred at 0), or uniform U(0, 1) (the default of diffusers' Flux scripts, `--weighting_scheme
  none`); then the flow shift sigma' = S sigma / (1 + (S - 1) sigma) for a fixed S, or `auto`: the pipeline's own
  resolution-dependent shift.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_snr

from stk.errors import InputError
from stk.models.families import Family, all_specs, spec_for

__all__ = [
    "TIMESTEP_SAMPLINGS",
    "LossSettings",
    "drop_captions",
    "flow_shift",
    "min_snr_weights",
    "offset_noise",
    "sample_u",
]

TIMESTEP_SAMPLINGS = ("logit-normal", "sigmoid", "uniform")


@dataclass(frozen=True)
class LossSettings:
    snr_gamma: float | None = None  # min-SNR-gamma weighting; None: every timestep weighs 1
    noise_offset: float = 0.0
    timestep_sampling: str = "logit-normal"  # flow families (FamilySpec.flow)
    logit_mean: float = 0.0  # flow, logit-normal
    logit_std: float = 1.0  # flow, logit-normal and sigmoid
    flow_shift: float | None = None  # flow; None: auto, the scheduler's own shift
    caption_dropout: float = 0.0  # probability of training a sample on the empty caption

    def check(self, family: Family) -> None:
        """Refuse settings that mean nothing for `family` or at all, before any model loads."""
        spec = spec_for(family)
        problems = []
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            problems.append(f"--snr-gamma {self.snr_gamma:g} must be positive (5 is the paper's)")
        if self.noise_offset < 0:
            problems.append(f"--noise-offset {self.noise_offset:g} must be 0 or more")
        if not 0 <= self.caption_dropout <= 1:
            problems.append(f"--caption-dropout {self.caption_dropout:g} is a probability: from 0 to 1 (0.1 is usual)")
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            problems.append(f"--timestep-sampling {self.timestep_sampling}: choose one of {TIMESTEP_SAMPLINGS}")
        if self.logit_std <= 0:
            problems.append(f"--logit-std {self.logit_std:g} must be positive")
        if self.flow_shift is not None and self.flow_shift <= 0:
            problems.append(f"--flow-shift {self.flow_shift:g} must be positive, or auto")
        if self.timestep_sampling == "sigmoid" and self.logit_mean != 0:
            problems.append("--timestep-sampling sigmoid is centred at 0: use logit-normal for --logit-mean")
        if spec.flow and (self.snr_gamma is not None or self.noise_offset):
            ddpm = _titles(flow=False)
            problems.append(f"--snr-gamma and --noise-offset are for {ddpm} (DDPM noise); {spec.title} is a flow model")
        flow_only = self.timestep_sampling != "logit-normal" or self.logit_mean or self.logit_std != 1.0
        if not spec.flow and (flow_only or self.flow_shift is not None):
            problems.append(
                f"--timestep-sampling, --logit-mean, --logit-std and --flow-shift are for {_titles(flow=True)}"
            )
        if problems:
            raise InputError("; ".join(problems))

    def run_settings(self) -> dict[str, Any]:
        """Part of a run's math: a checkpoint records them (stk.train.options)."""
        return asdict(self)


def _titles(flow: bool) -> str:
    """The families of one kind, as messages name them: "SD and SDXL"."""
    titles = [spec.title for spec in all_specs() if spec.flow is flow]
    return " and ".join([", ".join(titles[:-1]), titles[-1]] if len(titles) > 2 else titles)


def drop_captions(
    text: dict[str, torch.Tensor], empty: dict[str, torch.Tensor], probability: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The batch's caption embeddings (B, L, D) / (B, D), each sample's replaced by the empty caption's (L', D) /
    (D,) with `probability` (one uniform draw per sample from the CPU generator). Sequences of unequal length are
    zero-padded to the longer, as a batch of captions stored without padding is."""
    batch = next(iter(text.values())).shape[0]
    dropped = torch.rand((batch,), generator=generator) < probability
    if not dropped.any():
        return text
    out = {}
    for name, values in text.items():
        blank = empty[name].to(values.device, values.dtype)
        if values.ndim == 3:
            length = max(values.shape[1], blank.shape[0])
            values = F.pad(values, (0, 0, 0, length - values.shape[1]))
            blank = F.pad(blank, (0, 0, 0, length - blank.shape[0]))
        out[name] = torch.where(dropped.view(-1, *([1] * (values.ndim - 1))).to(values.device), blank, values)
    return out


def min_snr_weights(scheduler: Any, timesteps: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """(B,) float32 weights of each sample's MSE under min-SNR-gamma, for a DDPM scheduler's timesteps."""
    snr = compute_snr(scheduler, timesteps)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / snr if prediction_type == "epsilon" else clipped / (snr + 1)


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """`noise` plus `offset` times one N(0, 1) draw per image and channel (from the CPU generator)."""
    b, c = noise.shape[:2]
    shift = torch.randn((b, c, *([1] * (noise.ndim - 2))), generator=generator)
    return noise + offset * shift.to(noise.device, noise.dtype)


def sample_u(settings: LossSettings, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B,) float32 noise levels in (0, 1) before the shift, on the CPU."""
    if settings.timestep_sampling == "uniform":
        return torch.rand((batch_size,), generator=generator)
    mean = settings.logit_mean if settings.timestep_sampling == "logit-normal" else 0.0
    return compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=batch_size, logit_mean=mean, logit_std=settings.logit_std,
        generator=generator,
    )  # fmt: skip


def flow_shift(u: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's and FlowMatchEulerDiscreteScheduler's static shift of noise levels toward noise (shift > 1)."""
    return shift * u / (1 + (shift - 1) * u)
