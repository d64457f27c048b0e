"""What a scan asks of a cache: one ImageJob per scan row, keyed under a cache config's recipes, and the rows a
cache must hold (those the last build did not skip as bad input). stk-cache encodes the jobs; stk-cache verify
and stk-train check a cache covers them. Nothing here loads a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stk import storage
from stk.scan.reader import ScanTable, read_scan
from stk.shards.config import CacheConfig
from stk.shards.keys import latent_key, text_key

__all__ = ["ERRORS", "ImageJob", "expected_jobs", "jobs_for"]

ERRORS = "errors.jsonl"  # CACHE/errors.jsonl: the records the last build could not encode
# errors.jsonl kinds that a rerun would meet again: their records are reported, not expected
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
    """Keys of the records the last build skipped as bad input (CACHE/errors.jsonl). A changed
    image gets another key, so it is expected again."""
    try:
        raw = storage.read_bytes(storage.join(cache, ERRORS))
    except FileNotFoundError:
        return set()
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return {str(r["key"]) for r in rows if r.get("kind") in BAD_INPUT and r.get("key")}


def expected_jobs(cache: str, config: CacheConfig, scan_dir: str) -> tuple[list[ImageJob], int]:
    """The scan rows the cache must hold (with their keys under its config's recipes), and how many
    rows the last build skipped as bad input (not expected)."""
    jobs = jobs_for(read_scan(scan_dir), config.latent_recipe(), config.text_recipe())
    skipped = _bad_input_keys(cache)
    kept = [j for j in jobs if j.key not in skipped]
    return kept, len(jobs) - len(kept)
