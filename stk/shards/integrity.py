"""Is a shard file the one the manifest lists? Its size and sha256, checked by `stk-cache verify` and
by every reader before it trusts a shard's bytes.

Latent chunks are zstd frames without a checksum and text embeddings are raw frames, so one
flipped byte decodes to wrong numbers without any error: only the manifest's sha256, computed
when the shard was closed, tells. A damaged shard stops the job with CacheIncomplete (exit 6), the
code `stk-cache verify` gives for the same finding, since the fix is the same: `--repair` unlists
the shard and rerunning stk-cache encodes its records again. Rerunning the job alone (what the
sbatch templates do for infrastructure failures) would meet the same bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import zstandard

from stk.errors import CacheIncomplete, described
from stk.shards.layout import SHARDS_DIR, file_sha256

__all__ = ["MISSING", "damaged", "named_damage", "problem"]

MISSING = "missing"


def problem(path: str, entry: dict[str, Any], sha256: bool = True) -> str | None:
    """Why the local file `path` is not the shard `entry` of a manifest (None when it is): missing,
    another size, or (with `sha256`) another sha256."""
    try:
        size = os.path.getsize(path)
        if size != int(entry["bytes"]):
            return f"{size} bytes, the manifest lists {entry['bytes']}"
        if sha256:
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                return f"sha256 {digest}, the manifest lists {entry['sha256']}"
    except FileNotFoundError:
        return MISSING
    return None


def damaged(location: str, why: str) -> CacheIncomplete:
    """The one-line error for a shard (its cache location) that is not what the manifest lists."""
    cache = location.rsplit(f"/{SHARDS_DIR}/", 1)[0]
    return CacheIncomplete(
        f"shard {location} is damaged ({why}): run `stk-cache verify {cache} --repair`, rerun stk-cache "
        "(it encodes the shard's samples again), then rerun this command"
    )


@contextlib.contextmanager
def named_damage(path: str, location: str, entry: dict[str, Any]) -> Iterator[None]:
    """Reads of a shard that passed its check: one that fails anyway was changed under the job (cut short, rewritten)
    and is the damaged shard (exit 6, named with its fix), not a traceback (zstd's ZstdError on a cut frame, HDF5's
    OSError). `path` is the local file (an S3 shard's copy), `location` the shard's place in the cache."""
    try:
        yield
    except (OSError, ValueError, KeyError, zstandard.ZstdError) as exc:
        why = problem(path, entry, sha256=False)
        if why is None and isinstance(exc, OSError) and exc.errno is not None:
            raise  # the storage failed (an I/O error, a stale NFS handle), not the shard: as any such failure
        raise damaged(location, why or f"unreadable: {described(exc)}") from None
