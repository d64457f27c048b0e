"""stk-cache verify and info: what a cache holds, and whether it covers a scan."""

from __future__ import annotations

from typing import Any

import numpy as np

from stk import storage
from stk.cluster.lease import Lease, leased
from stk.errors import CacheIncomplete, InputError
from stk.log import get_logger
from stk.shards import CacheReader, Manifest, VerifyReport, shard_location, verify
from stk.shards.jobs import ScanRows, expected_keys
from stk.shards.manifest import ManifestDamaged
from stk.shards.rebuild import rebuild_manifest

__all__ = ["cache_info", "cache_lease", "verify_cache"]

LISTED = 20  # missing keys named in the error message; the JSON report has them all

log = get_logger("cache")


def _unlist_bad_shards(cache: str, report: VerifyReport) -> list[str]:
    """Drop missing and damaged shards from the manifest (and delete the damaged files), so that
    rerunning stk-cache encodes their samples again."""
    manifest = Manifest.load(cache)
    assert manifest is not None
    bad = set(report.missing_shards) | {why.split(":", 1)[0] for why in report.damaged_shards}
    manifest.shards = [s for s in manifest.shards if s["name"] not in bad]
    manifest.save(cache)
    for name in sorted(bad):
        storage.delete(shard_location(cache, name))
    return sorted(bad)


def cache_lease(cache: str) -> Lease | None:
    """The one-writer lease of a cache directory (stk-cache, `verify --repair`); an s3:// cache has
    none (stk/cluster/lease.py says why)."""
    return None if storage.is_s3(cache) else Lease(cache, "stk-cache", "--out")


def _load_or_rebuild(cache: str, repair: bool) -> tuple[Manifest, list[str]]:
    """The manifest; with `repair`, one that cannot be read is rebuilt from the intact shards (and
    the shards it could not list are named: "name: why")."""
    try:
        manifest = Manifest.load(cache)
    except ManifestDamaged as exc:
        if not repair:
            raise
        log.warning("%s is damaged (%s): --repair rebuilds it from the shards", exc.location, exc.why)
        rebuilt = rebuild_manifest(cache)
        log.warning("--repair: rebuilt %s from %d intact shard(s)", exc.location, len(rebuilt.manifest.shards))
        return rebuilt.manifest, rebuilt.dropped
    if manifest is None:
        raise InputError(f"{cache}: no manifest.json (not an stk cache)")
    return manifest, []


def verify_cache(cache: str, scan_dir: str | None, repair: bool = False) -> VerifyReport:
    """Checksums of every shard, and (with a scan) a latent and a caption for every scan row.
    Raises CacheIncomplete, listing what is missing, when anything is. `repair` holds the cache's
    lease: it rewrites the manifest."""
    with leased(cache_lease(cache) if repair else None):
        return _verify_cache(cache, scan_dir, repair)


def _verify_cache(cache: str, scan_dir: str | None, repair: bool) -> VerifyReport:
    manifest, dropped = _load_or_rebuild(cache, repair)
    report, paths = (verify(cache), {}) if scan_dir is None else _verify_rows(cache, manifest, ScanRows(scan_dir))
    report.damaged_shards += dropped  # deleted by the rebuild: their samples are encoded again by stk-cache
    repaired = _unlist_bad_shards(cache, report) if repair else []
    if not report.ok:
        lines = [f"{cache} is incomplete:"]
        lines += [f"  missing shard: {name}" for name in report.missing_shards]
        lines += [f"  damaged shard: {why}" for why in report.damaged_shards]
        if report.missing_latent_keys.size:
            lines.append(f"  {len(report.missing_latent_keys)} scan rows have no latent:")
            lines += [f"    {paths.get(key, key.decode())}" for key in report.missing_latent_keys[:LISTED].tolist()]
        if report.missing_text_keys.size:
            lines.append(f"  {len(report.missing_text_keys)} captions have no embedding")
        if repaired:
            lines.append(f"--repair: unlisted and deleted {len(repaired)} shard(s): {', '.join(repaired)}")
        elif report.missing_shards or report.damaged_shards:
            lines.append("Run `stk-cache verify --repair` to unlist the bad shards first.")
        lines.append("Rerun the same stk-cache command to encode what is missing.")
        raise CacheIncomplete("\n".join(lines))
    return report


def _verify_rows(cache: str, manifest: Manifest, scan: ScanRows) -> tuple[VerifyReport, dict[bytes, str]]:
    """verify, expecting the scan's rows (as keys: no Python object per row), and the paths of the first missing
    ones, which the error names."""
    keys, texts, rows = expected_keys(cache, manifest.cache_config(cache), scan)
    report = verify(cache, keys, texts)
    report.bad_input = scan.rows - len(rows)
    at = np.flatnonzero(np.isin(keys, report.missing_latent_keys[:LISTED].astype(keys.dtype)))
    paths = scan.take(rows[at], ["path"]).column("path").to_pylist()
    return report, dict(zip(keys[at].tolist(), paths, strict=True))


def cache_info(cache: str) -> dict[str, Any]:
    """A JSON-able summary: samples, buckets, bytes and compression, model. Shards are not hashed
    (that is what verify is for): a few samples are read to size them."""
    with CacheReader(cache, check_sha256=False) as reader:
        manifest = reader.manifest
        config = manifest.cache_config(cache)
        buckets = reader.buckets()
        latent_raw = 0
        for keys in buckets.values():
            record = reader.latent(keys[0])
            per_record = record.mean.nbytes + (record.logvar.nbytes if record.logvar is not None else 0)
            latent_raw += per_record * len(keys)
        text_keys = reader.text_keys()
        text_raw = sum(sum(a.nbytes for a in reader.text(k).arrays.values()) for k in text_keys)
    stored = sum(int(s["bytes"]) for s in manifest.shards)
    return {
        "cache": cache,
        "family": config.family,
        "model": config.model.get("model"),
        "latents": sum(len(k) for k in buckets.values()),
        "texts": len(text_keys),
        "buckets": {f"{h}x{w}": len(keys) for (h, w), keys in buckets.items()},  # latent height x width
        "shards": len(manifest.shards),
        "bytes": stored,
        "raw_bytes": latent_raw + text_raw,
        "compression_ratio": round((latent_raw + text_raw) / stored, 3) if stored else None,
        **config.norm.to_json(),
        "settings": {"latents": config.latent_settings(), "text": config.text_settings()},
    }
