"""Check a cache against its manifest: every listed shard there, whole (sha256), and readable,
and every expected key present."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stk import storage
from stk.errors import InputError
from stk.shards.integrity import MISSING, problem
from stk.shards.layout import open_h5, shard_keys, shard_location
from stk.shards.manifest import Manifest

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    shards: int  # listed in the manifest
    latents: int = 0  # distinct keys in the intact shards
    texts: int = 0
    missing_shards: list[str] = field(default_factory=list)
    damaged_shards: list[str] = field(default_factory=list)  # "name: why" (checksum, size, unreadable)
    missing_latent_keys: list[str] = field(default_factory=list)
    missing_text_keys: list[str] = field(default_factory=list)
    bad_input: int = 0  # scan rows not expected: the build skipped them as bad input (errors.jsonl)

    @property
    def ok(self) -> bool:
        return not (self.missing_shards or self.damaged_shards or self.missing_latent_keys or self.missing_text_keys)


def _check(path: str, entry: dict[str, Any]) -> tuple[str | None, list[str], list[str]]:
    """Why a local shard file is damaged (or None), and its latent and text keys."""
    why = problem(path, entry)
    if why is not None:
        return why, [], []
    try:
        with open_h5(path, "r") as file:
            latents, texts = shard_keys(file)
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}", [], []
    found = sum(len(keys) for keys in latents.values())
    if (found, len(texts)) != (entry["latents"], entry["texts"]):
        listed = f"{entry['latents']} and {entry['texts']}"
        return f"{found} latents and {len(texts)} texts, the manifest lists {listed}", [], []
    return None, [k for keys in latents.values() for k in keys], texts


def verify(
    cache: str, expected_latent_keys: Iterable[str] | None = None, expected_text_keys: Iterable[str] | None = None
) -> VerifyReport:
    """Recompute every listed shard's sha256 (an s3:// shard is downloaded to a temp file, one at
    a time) and report missing or damaged shards, and expected keys that no intact shard holds."""
    manifest = Manifest.load(cache)
    if manifest is None:
        raise InputError(f"{cache}: no manifest.json (not a cache, or stk-cache has not finished a shard yet)")
    report = VerifyReport(shards=len(manifest.shards))
    latent_keys: set[str] = set()
    text_keys: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="stk-verify-") as scratch:
        for entry in manifest.shards:
            name = str(entry["name"])
            location = shard_location(cache, name)
            path = location
            try:
                if storage.is_s3(cache):
                    path = os.path.join(scratch, name)
                    storage.download_file(location, path)
                why, latents, texts = _check(path, entry)
            except FileNotFoundError:
                report.missing_shards.append(name)
                continue
            finally:
                if path != location and os.path.exists(path):
                    os.unlink(path)
            if why == MISSING:
                report.missing_shards.append(name)
            elif why is not None:
                report.damaged_shards.append(f"{name}: {why}")
            latent_keys.update(latents)
            text_keys.update(texts)
    report.latents, report.texts = len(latent_keys), len(text_keys)
    report.missing_latent_keys = sorted(set(expected_latent_keys or ()) - latent_keys)
    report.missing_text_keys = sorted(set(expected_text_keys or ()) - text_keys)
    return report
