"""Loading a pipeline's VAE and its tokenizer + text encoder pairs, with the checks and digests every family shares."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL  # deep import: mypy sees the real class
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from stk.errors import InputError
from stk.models.latents import LatentNorm
from stk.models.weightfiles import component_folder, files_digest, weight_files
from stk.shards.keys import digest

__all__ = [
    "TextEncoder",
    "config_digest",
    "latent_channels",
    "load_component",
    "load_text_encoder",
    "load_vae",
    "vae_config",
    "weights_digest",
]

# An empty tokenizer has nothing besides its special tokens: what CLIPTokenizer.from_pretrained returns offline
# for a hub id that is not cached, or for a missing folder (FACTS.md), instead of raising.
MIN_REGULAR_TOKENS = 64
WEIGHT_SAMPLES = 16  # per tensor, for weights_digest

_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "architectures"}

M = TypeVar("M", bound=torch.nn.Module)


def config_digest(config: dict[str, Any]) -> str:
    """Digest of a model config without what depends on where, how and by which version it was saved or loaded."""
    return digest({k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS})


def weights_digest(modules: Iterable[torch.nn.Module]) -> str:
    """Digest of an evenly strided sample of every parameter. Reading all of a 10 GB encoder would take long; a
    sample still changes when any trained tensor does, so a model fine-tuned in place gets a new digest."""
    picks = [
        p.detach().reshape(-1)[:: max(1, p.numel() // WEIGHT_SAMPLES)][:WEIGHT_SAMPLES].float()
        for module in modules
        for p in module.parameters()
    ]
    return hashlib.sha256(torch.cat(picks).cpu().numpy().tobytes()).hexdigest()


def load_component(load: Callable[..., Any], model: str, subfolder: str, **kwargs: Any) -> Any:
    try:
        return load(model, subfolder=subfolder, **kwargs)
    except OSError as exc:  # missing folder or weights, or a hub id that is not cached offline
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load {subfolder}/ of {model}: {first_line}") from exc


def _frozen(module: M, device: torch.device) -> M:
    """Inference only, on `device`; the meta device (an identity asked, no weights) keeps what was read on the CPU."""
    module.to(device if device.type != "meta" else torch.device("cpu"))
    module.eval()
    module.requires_grad_(False)
    return module


def load_vae(model: str, device: torch.device, dtype: torch.dtype, vae_class: type[Any] = AutoencoderKL) -> Any:
    """The pipeline's `vae/`, frozen, as `vae_class` (the family's `FamilySpec.latents.vae_class`)."""
    vae = load_component(vae_class.from_pretrained, model, "vae", dtype=dtype)
    return _frozen(vae, device)


def latent_channels(config: Any) -> int:
    """Channels of a VAE's latents: AutoencoderKL's `latent_channels`; diffusers' video VAEs call it `z_dim`."""
    return int(config["latent_channels"] if "latent_channels" in config else config["z_dim"])


def vae_config(vae: Any, norm: LatentNorm) -> dict[str, Any]:
    """Identifies the latents: the encoder half's weights only (a decoder-only fine-tune, like SD's ft-MSE VAE,
    makes the same latents), and their normalisation `norm` (a scaling and shift factor, or a mean and std per
    channel: from the VAE's config, or where the family's VAE keeps it, `Encoders._latent_norm`)."""
    encoder_half = [m for m in (vae.encoder, vae.quant_conv) if m is not None]
    return {
        "class": type(vae).__name__,
        "config_sha256": config_digest(dict(vae.config)),
        "weights_sample_sha256": weights_digest(encoder_half),
        "latent_channels": latent_channels(vae.config),
        **norm.to_json(),
    }


@dataclass(frozen=True)
class TextEncoder:
    """A tokenizer and the text encoder it feeds, with their pipeline subfolders."""

    subfolder: str
    tokenizer_subfolder: str
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel  # on the meta device where only its identity was asked (load_text_encoder)
    max_length: int
    weights_sha256: str  # stk.models.weightfiles.files_digest of its files, in the dtype it was loaded in

    def tokenize(self, captions: list[str], padding: str = "max_length") -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) on the encoder's device, padded to max_length like diffusers' encode_prompt
        (`padding="longest"`: to the longest caption, where the pipeline pads so)."""
        batch = self.tokenizer(
            captions, padding=padding, max_length=self.max_length, truncation=True, return_tensors="pt"
        )
        return batch["input_ids"].to(self.model.device), batch["attention_mask"].to(self.model.device)

    def config(self) -> dict[str, Any]:
        vocab = sorted(self.tokenizer.get_vocab().items())
        return {
            "subfolder": self.subfolder,
            "class": type(self.model).__name__,
            "config_sha256": config_digest(self.model.config.to_diff_dict()),
            "weights_files_sha256": self.weights_sha256,
            "tokenizer": {
                "subfolder": self.tokenizer_subfolder,
                "class": type(self.tokenizer).__name__,
                "vocab_sha256": digest(vocab),
                "max_length": self.max_length,
            },
        }


def load_text_encoder(
    model: str,
    suffix: str,
    tokenizer_class: Any,  # a tokenizer class, or AutoTokenizer
    encoder_class: type[PreTrainedModel],
    device: torch.device,
    dtype: torch.dtype,
    max_length: int | None = None,
) -> TextEncoder:
    """`tokenizer{suffix}/` and `text_encoder{suffix}/`. The sequence length is the tokenizer's, capped by
    `max_length`, else by the encoder's position embeddings. The tokenizer is checked before the encoder loads. A
    multimodal encoder (a vision-language model) is read by its text config. On the meta `device` the encoder is
    built without its weights, for its identity (`TextEncoder.config`), which its files give; a model without
    safetensors files is loaded on the CPU for it."""
    tokenizer_subfolder, subfolder = f"tokenizer{suffix}", f"text_encoder{suffix}"
    tokenizer = load_component(tokenizer_class.from_pretrained, model, tokenizer_subfolder)
    size = len(tokenizer)
    if size - len(tokenizer.all_special_tokens) < MIN_REGULAR_TOKENS:
        raise InputError(
            f"the tokenizer in {model}/{tokenizer_subfolder} loaded empty (vocab size {size}): the folder is missing "
            "or incomplete, or the model is a hub id that is not in the local cache while offline"
        )
    folder = component_folder(model, subfolder)
    files = weight_files(folder) if folder is not None else None
    if device.type == "meta" and files is not None:
        config = load_component(AutoConfig.from_pretrained, model, subfolder)
        with torch.device("meta"):
            encoder = encoder_class._from_config(config, dtype=dtype)
    else:
        encoder = _frozen(load_component(encoder_class.from_pretrained, model, subfolder, dtype=dtype), device)
    weights = files_digest(files, dtype) if files is not None else weights_digest([encoder])
    text_config = encoder.config.get_text_config()
    if size > text_config.vocab_size:
        raise InputError(
            f"the tokenizer in {model}/{tokenizer_subfolder} has {size} tokens but {subfolder} embeds only "
            f"{text_config.vocab_size}: they do not belong together"
        )
    limit = max_length if max_length is not None else text_config.max_position_embeddings
    length = min(tokenizer.model_max_length, limit)
    return TextEncoder(subfolder, tokenizer_subfolder, tokenizer, encoder, length, weights)
