"""What every model family provides to stk-cache and stk-train: a VAE and text encoders behind one interface."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from stk.models.components import TextEncoder, latent_channels, vae_config
from stk.models.families.registry import Family
from stk.models.latents import LatentNorm
from stk.models.textmask import TEXT_MASK

__all__ = ["Encoders", "TextEmbedding", "identity_differences"]

# how identity_differences names a field; factors are shown with both values
_FIELDS = {
    "weights_sample_sha256": "weights",
    "weights_files_sha256": "weights",
    "config_sha256": "config",
    "vocab_sha256": "vocabulary",
}
_SHOWN = ("scaling_factor", "shift_factor", "latent_channels", "latents_mean", "latents_std", "latents_patch_size")
_SHOWN_VALUES = 3  # of a per-channel list


@dataclass
class TextEmbedding:
    """One caption's outputs as numpy (stored without torch): sequences (L, D), pooled vectors (D,), float32.
    `length` counts the real tokens of the longest sequence, so padding can be trimmed or masked."""

    arrays: dict[str, np.ndarray]
    length: int


@dataclass
class Encoders(abc.ABC):
    """A model's VAE and text encoders, frozen on one device. Each family subclasses it with its own loading and
    its diffusers pipeline's encode_prompt, so stk-train conditions on exactly what the pipeline would."""

    family: ClassVar[Family]
    text_outputs: ClassVar[tuple[str, ...]]  # names of the arrays in each TextEmbedding; TEXT_MASK: padding masked
    # the VAE encodes videos (B, C, T, H, W): an image goes in as one frame, and its latents come out without the
    # frame axis, (B, C, h, w) like every other family's, so what the cache stores and the trainer reads is the same
    vae_frames: ClassVar[bool] = False

    model: str  # local directory or hub id
    vae: Any = field(repr=False)  # the family's VAE (FamilySpec.latents.vae_class), a diffusers AutoencoderKL or alike
    text: tuple[TextEncoder, ...] = field(repr=False)
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)
    norm: LatentNorm = field(init=False)  # how the denoiser's latents are made from the VAE's
    latent_channels: int = field(init=False)

    def __post_init__(self) -> None:
        config = self.vae.config
        self.device = self.vae.device
        self.dtype = self.vae.dtype
        self.norm = self._latent_norm()
        self.latent_channels = latent_channels(config)

    def _latent_norm(self) -> LatentNorm:
        """The normalisation the VAE's config declares; a family whose VAE keeps it elsewhere says where."""
        return LatentNorm.from_vae_config(self.vae.config)

    @classmethod
    @abc.abstractmethod
    def load(cls, model: str, device: torch.device, dtype: torch.dtype) -> Encoders: ...

    @abc.abstractmethod
    def _encode_text(self, captions: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Batched outputs named as text_outputs, and the real token count per caption."""

    def place(self, text: torch.device, vae: torch.device) -> None:
        """Move the text encoders and the VAE (stk-cache --two-pass keeps one model on the GPU at a time); the
        "meta" device drops a component's weights, freeing its memory on the device and the host."""
        for encoder in self.text:
            module: torch.nn.Module = encoder.model
            module.to(text)
        self.vae.to(vae)
        self.device = torch.device(vae)

    def encode_images(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) in [-1, 1] on any device -> (mean, logvar) of the latent distribution, unscaled and
        unshifted, float32 on the CPU. Both, not a sample, so the trainer can draw a fresh sample every epoch."""
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"expected pixels shaped (B, 3, H, W), got {tuple(pixels.shape)}")
        frames = pixels.unsqueeze(2) if self.vae_frames else pixels
        with torch.inference_mode():
            dist = self.vae.encode(frames.to(self.device, self.dtype)).latent_dist
            mean, logvar = (dist.mean[:, :, 0], dist.logvar[:, :, 0]) if self.vae_frames else (dist.mean, dist.logvar)
            return mean.float().cpu().contiguous(), logvar.float().cpu().contiguous()

    def encode_text(self, captions: list[str]) -> list[TextEmbedding]:
        """One embedding per caption, in order; the captions are encoded as one batch. Where the pipeline masks
        padding (TEXT_MASK), each caption keeps its real tokens only: the padding's values are never attended to."""
        if isinstance(captions, str):
            raise TypeError("captions must be a list of strings, not one string")
        if not captions:
            return []
        with torch.inference_mode():
            outputs, lengths = self._encode_text(captions)
            arrays = {name: outputs[name].float().cpu().numpy() for name in self.text_outputs}
        counts = [int(n) for n in lengths.tolist()]
        if TEXT_MASK in self.text_outputs:
            return [
                TextEmbedding({n: a[i, :n_real] if a.ndim == 3 else a[i] for n, a in arrays.items()}, n_real)
                for i, n_real in enumerate(counts)
            ]
        return [TextEmbedding({n: a[i] for n, a in arrays.items()}, counts[i]) for i in range(len(captions))]

    def config(self) -> dict[str, Any]:
        """JSON-able identity of the encoders: equal configs give interchangeable outputs. `vae` alone identifies
        the latents and `text` alone the text embeddings, so a cache can key each on its own part."""
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "family": self.family.value,
            "model": self.model,
            "vae": {**vae_config(self.vae, self.norm), "dtype": dtype},
            "text": {
                "outputs": list(self.text_outputs),
                "dtype": dtype,
                "encoders": [encoder.config() for encoder in self.text],
            },
        }


def identity_differences(cached: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """How the `Encoders.config()` a cache records differs from a model's, one item per component
    that differs ("vae: weights, scaling_factor 0.13 in the cache, 0.18 in the model",
    "text_encoder_2: weights"); empty when both give the same outputs. The model's path or hub id
    is not compared: a copy elsewhere is the same model."""
    pairs = [("vae", cached.get("vae") or {}, model.get("vae") or {})]
    before = {e.get("subfolder"): e for e in (cached.get("text") or {}).get("encoders", [])}
    after = {e.get("subfolder"): e for e in (model.get("text") or {}).get("encoders", [])}
    pairs += [(str(name), before.get(name) or {}, after.get(name) or {}) for name in sorted({*before, *after}, key=str)]
    out = []
    for component, old, new in pairs:
        if not old or not new:
            out.append(f"{component}: {'not in the cache' if not old else 'not in the model'}")
        elif old != new:
            out.append(f"{component}: {', '.join(_fields(old, new))}")
    return out


def _fields(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The fields that differ, named for people; nested tables (the tokenizer) with their name in front."""
    out = []
    for name in sorted(k for k in {*old, *new} if old.get(k) != new.get(k)):
        before, after = old.get(name), new.get(name)
        if isinstance(before, dict) and isinstance(after, dict):
            out += _fields(before, after, f"{prefix}{name} ")
        elif name in _SHOWN:
            out.append(f"{prefix}{name} {_shown(before)} in the cache, {_shown(after)} in the model")
        else:
            out.append(prefix + _FIELDS.get(name, name))
    return out


def _shown(value: Any) -> str:
    """A factor as is; a per-channel list by its first values and its length."""
    if isinstance(value, list) and len(value) > _SHOWN_VALUES:
        return "[" + ", ".join(f"{v:.4g}" for v in value[:_SHOWN_VALUES]) + f", ... ({len(value)} values)]"
    return str(value)
