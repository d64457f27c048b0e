"""Check a cache against its manifest: every listed shard there, whole (sha256), and readable,
and every expected key present."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stk import storage
from stk.errors import InputError
from stk.shards.integrity import MISSING, problem
from stk.shards.layout import open_h5, shard_key_arrays, shard_location
from stk.shards.manifest import Manifest

__all__ = ["VerifyReport", "verify"]


_NONE: np.ndarray = np.zeros(0, "S1")


@dataclass
class VerifyReport:
    shards: int  # listed in the manifest
    latents: int = 0  # distinct keys in the intact shards
    texts: int = 0
    missing_shards: list[str] = field(default_factory=list)
    damaged_shards: list[str] = field(default_factory=list)  # "name: why" (checksum, size, unreadable)
    # the expected keys no intact shard holds, sorted, as bytes: a cache verified against a scan it has hardly
    # begun misses nearly every row, and a Python string per key would be its own memory problem at 100M rows
    missing_latent_keys: np.ndarray = field(default_factory=lambda: _NONE)
    missing_text_keys: np.ndarray = field(default_factory=lambda: _NONE)
    bad_input: int = 0  # scan rows not expected: the build skipped them as bad input (errors.jsonl)

    @property
    def ok(self) -> bool:
        missing_keys = self.missing_latent_keys.size or self.missing_text_keys.size
        return not (self.missing_shards or self.damaged_shards or missing_keys)


def _check(path: str, entry: dict[str, Any]) -> tuple[str | None, list[np.ndarray], np.ndarray]:
    """Why a local shard file is damaged (or None), and its latent and text keys (bytes arrays)."""
    why = problem(path, entry)
    if why is not None:
        return why, [], _NONE
    try:
        with open_h5(path, "r") as file:
            latents, texts = shard_key_arrays(file)
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}", [], _NONE
    found = sum(len(keys) for keys in latents.values())
    if (found, len(texts)) != (entry["latents"], entry["texts"]):
        listed = f"{entry['latents']} and {entry['texts']}"
        return f"{found} latents and {len(texts)} texts, the manifest lists {listed}", [], _NONE
    return None, list(latents.values()), texts


def _missing(expected: Iterable[str] | np.ndarray | None, found: list[np.ndarray]) -> np.ndarray:
    """The expected keys no intact shard holds, sorted (arrays compared: no Python object per key)."""
    if expected is None:
        return _NONE
    wanted = expected if isinstance(expected, np.ndarray) else np.array([k.encode() for k in expected], dtype=bytes)
    held = np.concatenate(found) if found else _NONE
    return np.setdiff1d(wanted, held)


def verify(
    cache: str,
    expected_latent_keys: Iterable[str] | np.ndarray | None = None,
    expected_text_keys: Iterable[str] | np.ndarray | None = None,
) -> VerifyReport:
    """Recompute every listed shard's sha256 (an s3:// shard is downloaded to a temp file, one at
    a time) and report missing or damaged shards, and expected keys that no intact shard holds."""
    manifest = Manifest.load(cache)
    if manifest is None:
        raise InputError(f"{cache}: no manifest.json (not a cache, or stk-cache has not finished a shard yet)")
    report = VerifyReport(shards=len(manifest.shards))
    latent_keys: list[np.ndarray] = []  # each intact shard's, as stored
    text_keys: list[np.ndarray] = []
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
            latent_keys += latents
            text_keys.append(texts)
    report.latents, report.texts = (len(np.unique(np.concatenate(k))) if k else 0 for k in (latent_keys, text_keys))
    report.missing_latent_keys = _missing(expected_latent_keys, latent_keys)
    report.missing_text_keys = _missing(expected_text_keys, text_keys)
    return report
