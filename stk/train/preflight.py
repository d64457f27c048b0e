"""Checks that run before any model loads, so a job that cannot work fails in seconds, not after
minutes of loading weights on 32 GPUs: the output directory is one directory shared by every rank,
every node has the same GPUs, the cache covers the scan table, and every bucket fills a batch.

Each check is collective where it needs to be and ends every rank the same way on failure.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from stk import storage
from stk.buckets import BatchCheck, Bucket, ShortBucket
from stk.cluster.world import World
from stk.errors import BatchCheckFailed, CacheIncomplete, InputError, PreflightFailed
from stk.scan.outputs import BUCKETS
from stk.train.data.sampler import BucketKeys, Group

__all__ = ["check_buckets", "check_coverage", "check_gpu_layout", "check_shared_output", "scan_repeats"]

LISTED = 20
Shape = TypeVar("Shape", tuple[int, int], tuple[str, int, int])  # a bucket: latent (h, w), or a dataset's Group


def check_shared_output(world: World, output_dir: str) -> None:
    """Every rank writes a token into output_dir, then every rank must see every token: a directory
    on node-local disk (or a typo'd mount) shows up here instead of as a checkpoint that only some
    ranks wrote."""
    if storage.is_s3(output_dir):
        raise InputError(f"--output-dir {output_dir}: must be a shared filesystem path (NFS, Lustre), not S3")
    run = world.root_call(lambda: uuid.uuid4().hex[:12])
    tokens = os.path.join(output_dir, ".preflight", run)

    def write_token() -> None:
        try:
            os.makedirs(tokens, exist_ok=True)
            with open(os.path.join(tokens, f"rank-{world.rank}"), "w") as f:
                f.write(world.node)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise PreflightFailed(
                f"--output-dir {output_dir} is not writable from rank {world.rank} on {world.node}: {exc.strerror}"
            ) from exc

    world.run_everywhere(write_token)
    world.barrier()
    names = set(os.listdir(tokens)) if os.path.isdir(tokens) else set()
    seen = tuple(r for r in range(world.size) if f"rank-{r}" in names)
    reports = world.allgather((world.rank, world.node, seen))
    world.barrier()
    if world.is_root:  # only this run's tokens: another run may be checking the same directory
        shutil.rmtree(tokens, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(tokens))
    world.run_everywhere(lambda: _one_view(output_dir, reports, world.size))  # every rank has it: said once


def _one_view(output_dir: str, reports: list[tuple[int, str, tuple[int, ...]]], size: int) -> None:
    """Raise PreflightFailed unless every rank saw every rank's token; the message groups the ranks
    by what they saw, the odd ones out (a node with a local copy of the directory) last."""
    views: dict[tuple[int, ...], list[tuple[int, str]]] = {}
    for rank, node, view in reports:
        views.setdefault(view, []).append((rank, node))
    if list(views) == [tuple(range(size))]:
        return
    lines = [f"--output-dir {output_dir} is not one directory shared by every rank:"]
    for view, members in sorted(views.items(), key=lambda item: -len(item[1])):
        nodes = ", ".join(sorted({node for _, node in members}))
        ranks = _ranges([rank for rank, _ in members])
        seen = f"see the files of rank(s) {_ranges(list(view))} only" if view else "see no rank's files"
        lines.append(f"  {nodes}, rank(s) {ranks}: {seen}")
    lines.append("Checkpoints and the final model need a path every node mounts (NFS, Lustre), the same on each.")
    raise PreflightFailed("\n".join(lines))


def check_gpu_layout(world: World, gpus_on_node: int) -> None:
    """The same number of GPUs on every node, and no more ranks on a node than it has GPUs (on a
    GPU job): an uneven allocation would stall ZeRO's collectives on the slowest node."""
    layout = world.allgather((world.node, gpus_on_node, world.local_size))
    nodes = {node: (gpus, ranks) for node, gpus, ranks in layout}
    counts = {gpus for gpus, _ in nodes.values()}
    if len(counts) > 1:
        listed = ", ".join(f"{node}: {gpus}" for node, (gpus, _) in sorted(nodes.items()))
        raise PreflightFailed(f"nodes have different numbers of GPUs ({listed}); ask Slurm for --gpus-per-node")
    crowded = [(node, gpus, ranks) for node, (gpus, ranks) in sorted(nodes.items()) if 0 < gpus < ranks]
    if crowded:
        listed = ", ".join(f"{node}: {ranks} ranks for {gpus} GPUs" for node, gpus, ranks in crowded)
        raise PreflightFailed(f"more ranks than GPUs on a node ({listed}); start one rank per GPU")


def scan_repeats(document: Mapping[str, Any], scan_dir: str, vae_scale_factor: int) -> dict[Group, tuple[int, int]]:
    """(dataset, latent h, latent w) -> (scan bucket id, repeats) from the scan's buckets.json `document` (repeats
    include the scan's --repeats and --allow-oversubscription); the dataset is "" in the scan of one source."""
    try:
        return {
            (
                str(b.get("dataset") or ""),
                int(b["height"]) // vae_scale_factor,
                int(b["width"]) // vae_scale_factor,
            ): (int(b["id"]), int(b["repeats"]))
            for b in document["buckets"]
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{storage.join(scan_dir, BUCKETS)}: not an stk-scan {BUCKETS} ({exc})") from None


def check_buckets(
    buckets: Mapping[Shape, BucketKeys],
    repeats: Mapping[Shape, int],
    effective: int,
    vae_scale_factor: int,
    oversubscribe: bool,
    bucket_ids: Mapping[Shape, int] | None = None,
) -> dict[Shape, int]:
    """Every bucket (latent (h, w), or a dataset's: (name, h, w)) must fill one effective batch (batch size x ranks x
    accumulation), counting its repeats. Returns the repeats to train with: each short bucket raised to its minimum
    when oversubscribing; otherwise BatchCheckFailed lists every short bucket, with its dataset, and the ways out."""
    ids = bucket_ids or {key: i for i, key in enumerate(sorted(buckets))}
    short = {
        key: ShortBucket(
            Bucket(ids[key], key[-1] * vae_scale_factor, key[-2] * vae_scale_factor),
            len(keys),
            len(keys) * repeats[key],
            math.ceil(effective / len(keys)),
        )
        for key, keys in sorted(buckets.items())
        if len(keys) and len(keys) * repeats[key] < effective
    }
    if short and not oversubscribe:
        message = BatchCheck(effective, min(repeats.values()), list(short.values())).message()
        for key, bucket in short.items():  # a dataset's bucket: named with its dataset
            if len(key) == 3 and key[0]:
                at = f"  bucket {bucket.bucket.id} ("
                message = message.replace(at, f"  dataset {key[0]!r}, bucket {bucket.bucket.id} (", 1)
        raise BatchCheckFailed(message)
    return {key: short[key].min_repeats if key in short else repeats[key] for key in buckets}


def check_coverage(missing_paths: list[str], missing_texts: int, cache: str, scan_dir: str) -> None:
    """The cache must hold a latent and a caption embedding for every scan row (rows the cache build
    skipped as bad input excepted)."""
    if not missing_paths and not missing_texts:
        return
    lines = [f"{cache} does not cover the scan {scan_dir}:"]
    if missing_paths:
        lines.append(f"  {len(missing_paths)} scan rows have no cached latent:")
        lines += [f"    {path}" for path in missing_paths[:LISTED]]
    if missing_texts:
        lines.append(f"  {missing_texts} captions have no cached embedding")
    lines.append(f"Run stk-cache on {scan_dir} into {cache} first (it only encodes what is missing).")
    raise CacheIncomplete("\n".join(lines))


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ", ".join(parts)
