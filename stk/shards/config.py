"""What a cache was made with (the manifest's `config`), typed: stk-cache writes it, stk-train reads it.

Two caches with equal configs are interchangeable; a cache is never extended under another. The JSON is
the manifest's `config` object and every shard's header, so `to_json` writes exactly what stk always wrote
(key order included) and `from_json` reads every cache stk has made. The key recipes (what a latent and a
text embedding depend on besides their image and caption) come from it, so keys can be recomputed from a
scan table without loading any model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from stk.errors import InputError
from stk.images.preprocess import CropMode
from stk.models.families import Family, spec_for
from stk.models.latents import LatentNorm
from stk.shards.keys import digest

__all__ = ["CacheConfig", "EncodeSettings"]

BUCKET_FIELDS = ("resolution", "resolution_type", "alignment")  # of the scan's buckets.json
DATASET_FIELDS = ("resolution", "resolution_type", "crop")  # of each of its "datasets" (a scan of several)


@dataclass(frozen=True)
class EncodeSettings:
    """How stk-cache stores what the encoders give (its options)."""

    crop: CropMode = CropMode.CENTER
    store_logvar: bool | None = None  # --latents params; None: as the family's diffusers example (for_family)
    dtype: str = "float16"  # how arrays are stored
    trim_padding: bool = False

    def for_family(self, family: Family) -> EncodeSettings:
        """These settings with the latents stored as `family`'s training example uses them, unless given: mean and
        log-variance where it trains on a sample of the latent distribution, the mean (its mode) where it does not."""
        if self.store_logvar is not None:
            return self
        return replace(self, store_logvar=spec_for(family).denoiser.example.samples_latents)


@dataclass(frozen=True)
class CacheConfig:
    family: str
    model: dict[str, Any]  # the encoders' identity (Encoders.config()): its `vae` and `text` parts key the records
    settings: EncodeSettings
    buckets: dict[str, Any]  # the scan's resolution, resolution_type and alignment (and its datasets', scan_buckets)
    norm: LatentNorm  # how stk-train normalises the stored latents for the denoiser

    def __post_init__(self) -> None:  # a config records what was stored, never "the family's default"
        object.__setattr__(self, "settings", self.settings.for_family(Family(self.family)))

    @staticmethod
    def scan_buckets(buckets_json: Mapping[str, Any]) -> dict[str, Any]:
        """What a cache records of the scan's buckets.json. A scan of several datasets adds the distinct resolutions
        and crops its datasets give (its top level holds the command's defaults), so a cache is not extended with
        images made another way; datasets added or renamed with settings the cache has are no difference."""
        recorded = {k: buckets_json.get(k) for k in BUCKET_FIELDS}
        datasets = buckets_json.get("datasets")
        if isinstance(datasets, list):
            distinct = {json.dumps({k: d.get(k) for k in DATASET_FIELDS}, sort_keys=True) for d in datasets}
            recorded["datasets"] = [json.loads(d) for d in sorted(distinct)]
        return recorded

    def latent_settings(self) -> dict[str, Any]:
        return {
            "crop": self.settings.crop.value,
            "store_logvar": self.settings.store_logvar,
            "dtype": self.settings.dtype,
        }

    def text_settings(self) -> dict[str, Any]:
        return {"trim_padding": self.settings.trim_padding, "dtype": self.settings.dtype}

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "model": self.model,
            "latents": self.latent_settings(),
            "text": self.text_settings(),
            "buckets": self.buckets,
            **self.norm.to_json(),
        }

    @staticmethod
    def from_json(data: Any, source: str) -> CacheConfig:
        """The config a manifest (at `source`, for errors) records; InputError when it is not one stk-cache made."""
        try:
            latents, text = data["latents"], data["text"]
            settings = EncodeSettings(
                CropMode(latents["crop"]),
                bool(latents["store_logvar"]),
                str(latents["dtype"]),
                bool(text["trim_padding"]),
            )
            model, buckets = data["model"], data["buckets"]
            if not isinstance(model, dict) or not isinstance(buckets, dict):
                raise TypeError("'model' or 'buckets' is not an object")
            return CacheConfig(str(data["family"]), model, settings, buckets, LatentNorm.from_vae_config(data))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{source}: no usable {exc} in its config (not made by stk-cache)") from None

    def latent_recipe(self) -> dict[str, Any]:
        """What a latent depends on besides its image: the VAE and how latents are stored."""
        return {"vae": digest(self.model["vae"]), "latents": self.latent_settings()}

    @staticmethod
    def with_crop(latent_recipe: dict[str, Any], crop: CropMode) -> dict[str, Any]:
        """A latent recipe (latent_recipe's) for an image cropped another way, as a dataset's crop asks: only its crop
        differs, and under its own crop it is the recipe itself (the same keys). A recipe naming no crop (not a
        cache's) is the same under any."""
        latents = latent_recipe.get("latents")
        if not isinstance(latents, dict) or "crop" not in latents:
            return latent_recipe
        return {**latent_recipe, "latents": {**latents, "crop": crop.value}}

    def text_recipe(self) -> dict[str, Any]:
        """What an embedding depends on besides its caption: the text encoders and the stored form."""
        return {"encoders": digest(self.model["text"]), "text": self.text_settings()}

    def differences(self, recorded: Mapping[str, Any]) -> list[str]:
        """The top-level keys in which a cache's recorded config (as JSON) and this one differ. The model's path
        or hub id is not compared: the same weights through a symlink or a copy elsewhere make the same cache
        (its components are identified by digests of their configs and weights, as stk-train compares them)."""

        def comparable(config: Mapping[str, Any]) -> dict[str, Any]:
            model = config.get("model")
            if isinstance(model, dict):
                model = {k: v for k, v in model.items() if k != "model"}
            return {**config, "model": model}

        old, new = comparable(recorded), comparable(self.to_json())
        return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
