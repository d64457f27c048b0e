"""The loss options people tune, each from its published formula; with none given, a family trains as its
diffusers training example does by default (FamilySpec.denoiser.example).

- min-SNR-gamma weighting (Hang et al. 2023, as diffusers' train_text_to_image.py applies it): a sample at
  timestep t weighs min(SNR(t), gamma) / SNR(t) for epsilon prediction, min(SNR(t), gamma) / (SNR(t) + 1) for
  v prediction. DDPM families (SD, SDXL).
- noise offset (crosslabs 2023): noise + offset * N(0, 1) drawn once per image and channel, so the model can
  learn to shift an image's mean brightness. DDPM families.
- caption dropout (as diffusers' examples' --proportion_empty_prompts): each sample's caption embedding is the
  empty caption's with probability P, so the model also learns the unconditional prediction that classifier-free
  guidance subtracts. Every family.
- the flow families' noise levels, as diffusers' flow examples draw them: u from --timestep-sampling (uniform U(0, 1),
  the scripts' `--weighting_scheme none`; logit-normal sigmoid(N(mean, std)), their `logit_normal`; sigmoid
  sigmoid(std * N(0, 1)), kohya's), then the sigma at index floor(1000 u) of the scheduler's descending training
  table, so sigma is about 1 - u (a --logit-mean above 0 favours less noise, as in the scripts). The table is
  shifted by the scheduler's static shift where it has one (SD3, Z-Image) and unshifted where it shifts dynamically,
  at inference only (FLUX.1, Chroma, FLUX.2, Qwen-Image). Each family's default sampling is its example's
  (FamilySpec.denoiser.example). --flow-shift S shifts the unshifted table by S instead, and `auto` as the pipeline
  shifts its schedule for the image's size.
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
    "FLOW_SHIFTS",
    "TIMESTEP_SAMPLINGS",
    "LossSettings",
    "drop_captions",
    "flow_shift",
    "min_snr_weights",
    "offset_noise",
    "sample_u",
]

TIMESTEP_SAMPLINGS = ("logit-normal", "sigmoid", "uniform")
FLOW_SHIFTS = ("example", "auto")  # besides a number: the example's training table, or the pipeline's own shift


@dataclass(frozen=True)
class LossSettings:
    snr_gamma: float | None = None  # min-SNR-gamma weighting; None: every timestep weighs 1
    noise_offset: float = 0.0
    timestep_sampling: str | None = None  # flow families (FamilySpec.denoiser.flow); None: the family's example's
    logit_mean: float = 0.0  # flow, logit-normal
    logit_std: float = 1.0  # flow, logit-normal and sigmoid
    flow_shift: float | str = "example"  # flow: a number, or one of FLOW_SHIFTS
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
        sampling = self.sampling(family)
        if sampling not in TIMESTEP_SAMPLINGS:
            problems.append(f"--timestep-sampling {sampling}: choose one of {TIMESTEP_SAMPLINGS}")
        if not self.logit_std > 0:
            problems.append(f"--logit-std {self.logit_std:g} must be positive")
        if isinstance(self.flow_shift, str) and self.flow_shift not in FLOW_SHIFTS:
            problems.append(f"--flow-shift {self.flow_shift}: a positive number, or one of {FLOW_SHIFTS}")
        elif not isinstance(self.flow_shift, str) and not 0 < self.flow_shift < float("inf"):
            problems.append(f"--flow-shift {self.flow_shift:g} must be a positive number, or one of {FLOW_SHIFTS}")
        if sampling == "sigmoid" and self.logit_mean != 0:
            problems.append("--timestep-sampling sigmoid is centred at 0: use logit-normal for --logit-mean")
        if spec.denoiser.flow and sampling == "uniform" and (self.logit_mean or self.logit_std != 1.0):
            problems.append(
                f"--logit-mean and --logit-std shape logit-normal sampling; {spec.title} draws uniformly by default "
                "(as its diffusers example): add --timestep-sampling logit-normal"
            )
        if spec.denoiser.flow and (self.snr_gamma is not None or self.noise_offset):
            ddpm = _titles(flow=False)
            problems.append(f"--snr-gamma and --noise-offset are for {ddpm} (DDPM noise); {spec.title} is a flow model")
        flow_only = self.timestep_sampling is not None or self.logit_mean or self.logit_std != 1.0
        if not spec.denoiser.flow and (flow_only or self.flow_shift != "example"):
            problems.append(
                f"--timestep-sampling, --logit-mean, --logit-std and --flow-shift are for {_titles(flow=True)}"
            )
        if problems:
            raise InputError("; ".join(problems))

    def sampling(self, family: Family) -> str:
        """The --timestep-sampling a run uses: the one given, else the family's example's."""
        return self.timestep_sampling or spec_for(family).denoiser.example.timestep_sampling

    def run_settings(self, family: Family) -> dict[str, Any]:
        """Part of a run's math: a checkpoint records them (stk.train.options), the sampling as used."""
        return {**asdict(self), "timestep_sampling": self.sampling(family)}


def _titles(flow: bool) -> str:
    """The families of one kind, as messages name them: "SD and SDXL"."""
    titles = [spec.title for spec in all_specs() if spec.denoiser.flow is flow]
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


def sample_u(settings: LossSettings, sampling: str, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B,) float32 draws in (0, 1) by `sampling` (LossSettings.sampling), on the CPU: the u that indexes the
    scheduler's table."""
    if sampling == "uniform":
        return torch.rand((batch_size,), generator=generator)
    mean = settings.logit_mean if sampling == "logit-normal" else 0.0
    return compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal",
        batch_size=batch_size,
        logit_mean=mean,
        logit_std=settings.logit_std,
        generator=generator,
    )


def flow_shift(u: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's and FlowMatchEulerDiscreteScheduler's static shift of noise levels toward noise (shift > 1)."""
    return shift * u / (1 + (shift - 1) * u)
