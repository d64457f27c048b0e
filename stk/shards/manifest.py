"""CACHE/manifest.json: what a cache was made with and which shards it holds.

A shard is listed only once it is closed, checksummed and renamed (uploaded on S3), so a reader
never meets a half-written one. The manifest is rewritten whole and atomically, by one process
(rank 0); shards live under CACHE/shards/.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stk import storage
from stk.errors import CacheIncomplete, InputError
from stk.shards.config import CacheConfig
from stk.shards.writer import ShardInfo

__all__ = ["MANIFEST", "MANIFEST_VERSION", "Manifest", "ManifestDamaged", "shard_entry"]

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_SHARD_FIELDS = ("name", "latents", "texts", "bytes", "sha256")


class ManifestDamaged(CacheIncomplete):
    """manifest.json cannot be read: `stk-cache verify --repair` rebuilds it from the shards."""

    def __init__(self, location: str, why: str) -> None:
        cache = location.rsplit("/", 1)[0]
        self.location, self.why = location, why
        super().__init__(
            f"{location} is damaged ({why}): run `stk-cache verify {cache} --repair` (it rebuilds the manifest "
            "from the intact shards), then rerun this command"
        )


def shard_entry(info: ShardInfo) -> dict[str, Any]:
    """What the manifest lists for a shard (the key lists stay in the shard itself)."""
    return {k: getattr(info, k) for k in _SHARD_FIELDS}


@dataclass
class Manifest:
    """`config`: the model and preprocessing the cache was made with, as JSON (a cache is never extended
    under another; `cache_config()` reads it); `shards`: [{name, latents, texts, bytes, sha256}];
    `scaling_factor`: the config's, repeated at the top level for other trainers (`new` sets it);
    `validation_prompts`: the prompts stk-cache embedded for stk-train's sample images (keyed like
    captions); `extra`: any other top-level keys, kept as they are."""

    config: dict[str, Any]
    shards: list[dict[str, Any]] = field(default_factory=list)
    scaling_factor: float | None = None
    validation_prompts: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new(config: CacheConfig) -> Manifest:
        """The manifest of a new cache made with `config`, listing no shard yet."""
        return Manifest(config=config.to_json(), scaling_factor=config.norm.scaling_factor)

    def cache_config(self, cache: str) -> CacheConfig:
        """The typed config of the cache at `cache` (for errors); InputError when stk-cache did not make it."""
        return CacheConfig.from_json(self.config, storage.join(cache, MANIFEST))

    def merge(self, entries: Iterable[dict[str, Any]]) -> None:
        """List the shards not listed yet: a shard recorded twice (by a rank's part file, then by
        the rank's report) is one shard."""
        listed = {s["name"] for s in self.shards}
        for entry in entries:
            if entry["name"] not in listed:
                self.shards.append(entry)
                listed.add(entry["name"])

    @staticmethod
    def load(cache: str) -> Manifest | None:
        """The cache's manifest, or None when there is none yet."""
        location = storage.join(cache, MANIFEST)
        try:
            raw = storage.read_bytes(location)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
            shards = data.pop("shards")
            if not isinstance(shards, list) or not all(isinstance(s, dict) and "name" in s for s in shards):
                raise TypeError("its shard list is not one")
            return Manifest.from_header(data, shards, location)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            kind = "not JSON" if isinstance(exc, ValueError) else f"not a cache manifest ({type(exc).__name__})"
            raise ManifestDamaged(location, f"{kind}: {exc}") from None

    @staticmethod
    def from_header(header: dict[str, Any], shards: list[dict[str, Any]], source: str) -> Manifest:
        """A manifest from its `header()` (read back from `source`, for errors) and a shard list."""
        data = dict(header)
        version = data.pop("version")
        if not isinstance(version, int) or version > MANIFEST_VERSION:
            raise InputError(f"{source}: manifest version {version!r}; this stk reads up to {MANIFEST_VERSION}")
        config = data.pop("config")
        if not isinstance(config, dict):
            raise TypeError("its config is not an object")
        return Manifest(
            config=config,
            shards=shards,
            scaling_factor=data.pop("scaling_factor", None),
            validation_prompts=[str(p) for p in data.pop("validation_prompts", [])],
            extra=data,
        )

    def header(self) -> dict[str, Any]:
        """Everything but the shard list: what each shard carries too, so that a lost manifest can be
        rebuilt from the shards (stk.shards.rebuild)."""
        return {
            "version": MANIFEST_VERSION,
            **self.extra,
            "config": self.config,
            "scaling_factor": self.scaling_factor,
            "validation_prompts": self.validation_prompts,
        }

    def save(self, cache: str) -> None:
        data = {**self.header(), "shards": self.shards}
        storage.write_atomic(storage.join(cache, MANIFEST), (json.dumps(data, indent=1) + "\n").encode())
