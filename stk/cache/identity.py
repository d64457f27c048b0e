"""What a cache is made of, as a format fact both stk-cache and stk-train rely on: the config two
interchangeable caches share, the recipes keys are made from, and the scan rows a cache must hold.

Nothing here loads a model: everything is recomputed from the manifest's config and the scan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from stk import storage
from stk.cache.keys import digest, latent_key, text_key
from stk.scan.reader import ScanTable, read_scan
from stk.shards import Manifest

if TYPE_CHECKING:
    from stk.cache.encode import EncodeSettings
    from stk.models import Encoders

__all__ = [
    "ERRORS",
    "ImageJob",
    "cache_config",
    "config_differences",
    "expected_jobs",
    "jobs_for",
    "latent_recipe",
    "text_recipe",
]

ERRORS = "errors.jsonl"  # CACHE/errors.jsonl: the samples the last build could not encode
# errors.jsonl kinds that a rerun would meet again: their samples are reported, not expected
BAD_INPUT = frozenset({"decode_failed", "nonfinite_latent", "nonfinite_embedding"})


@dataclass(frozen=True)
class ImageJob:
    path: str
    location: str
    bucket_width: int
    bucket_height: int
    caption: str
    key: str
    text_key: str

    @property
    def pixels(self) -> int:
        return self.bucket_width * self.bucket_height


def cache_config(encoders: Encoders, settings: EncodeSettings, buckets: dict[str, Any]) -> dict[str, Any]:
    """Everything that makes two caches interchangeable; a cache is never extended under another.
    `buckets`: the scan's buckets.json."""
    stored = asdict(settings)
    stored["crop"] = settings.crop.value
    return {
        "family": encoders.family.value,
        "model": encoders.config(),
        "latents": {k: stored[k] for k in ("crop", "store_logvar", "dtype")},
        "text": {k: stored[k] for k in ("trim_padding", "dtype")},
        "buckets": {k: buckets.get(k) for k in ("resolution", "resolution_type", "alignment")},
        "scaling_factor": encoders.scaling_factor,
        "shift_factor": encoders.shift_factor,
    }


def config_differences(cached: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The top-level keys in which a cache's recorded config and this run's differ. The model's path
    or hub id is not compared: the same weights through a symlink or a copy elsewhere make the same
    cache (its components are identified by digests of their configs and weights, as stk-train
    compares them)."""

    def comparable(config: dict[str, Any]) -> dict[str, Any]:
        model = config.get("model")
        if isinstance(model, dict):
            model = {k: v for k, v in model.items() if k != "model"}
        return {**config, "model": model}

    old, new = comparable(cached), comparable(current)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def latent_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """What a latent depends on besides its image: the VAE and how latents are stored."""
    return {"vae": digest(config["model"]["vae"]), "latents": config["latents"]}


def text_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """What an embedding depends on besides its caption: the text encoders and the stored form."""
    return {"encoders": digest(config["model"]["text"]), "text": config["text"]}


def jobs_for(scan: ScanTable, latent_recipe: dict[str, Any], text_recipe: dict[str, Any]) -> list[ImageJob]:
    """One job per scan row, keyed under the given recipes."""
    return [
        ImageJob(
            path=row["path"],
            location=scan.image_location(row["path"]),
            bucket_width=row["bucket_width"],
            bucket_height=row["bucket_height"],
            caption=row["caption"] or "",
            key=latent_key(row, latent_recipe),
            text_key=text_key(row["caption"] or "", text_recipe),
        )
        for row in scan.rows
    ]


def _bad_input_keys(cache: str) -> set[str]:
    """Keys of the samples the last build skipped as bad input (CACHE/errors.jsonl). A changed
    image gets another key, so it is expected again."""
    try:
        raw = storage.read_bytes(storage.join(cache, ERRORS))
    except FileNotFoundError:
        return set()
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return {str(r["key"]) for r in rows if r.get("kind") in BAD_INPUT and r.get("key")}


def expected_jobs(cache: str, manifest: Manifest, scan_dir: str) -> tuple[list[ImageJob], int]:
    """The scan rows the cache must hold (with their keys under the cache's recipe), and how many
    rows the last build skipped as bad input (not expected)."""
    jobs = jobs_for(read_scan(scan_dir), latent_recipe(manifest.config), text_recipe(manifest.config))
    skipped = _bad_input_keys(cache)
    kept = [j for j in jobs if j.key not in skipped]
    return kept, len(jobs) - len(kept)
