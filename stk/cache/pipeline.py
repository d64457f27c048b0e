"""The cache across ranks: plan on rank 0 (what is done, what to encode, who encodes it),
encode on every rank into its own shards, then list the shards in the manifest on rank 0."""

from __future__ import annotations

import gc
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stk import storage
from stk.cache.encode import Counters, encode_latents, encode_texts
from stk.cache.inspect import cache_lease
from stk.cache.memory import check_fits, load_failure, measured
from stk.cache.options import CacheOptions, CacheSummary
from stk.cache.parts import PartRecorder, read_parts, remove_parts
from stk.cache.plan import (
    RowShare,
    assign,
    batch_sums,
    cached_keys,
    distinct_captions,
    held,
    latent_batches,
    local_work_dir,
    owned,
    rank_share,
    text_batches,
    text_costs,
    token_counts,
)
from stk.cluster.lease import leased
from stk.cluster.world import World, split_work
from stk.errors import InputError, check_max_errors, parse_max_errors
from stk.failures import is_out_of_memory
from stk.log import get_logger
from stk.metadata import to_json_lines
from stk.models import Encoders, detect_family, load_encoders
from stk.models.alignment import check_aligned, model_alignment
from stk.models.load import compute_dtype
from stk.progress import Progress
from stk.prompts import EMPTY_CAPTION, read_prompts
from stk.scan.reader import read_buckets
from stk.shards import Manifest, ShardInfo, ShardWriter
from stk.shards.config import CacheConfig
from stk.shards.jobs import ERRORS, ScanRows, read_keys
from stk.shards.manifest import shard_entry
from stk.shards.staging import STAGED_SUFFIX
from stk.storage.failures import as_stk_error

__all__ = ["run_cache"]

log = get_logger("cache")


def _device(requested: str | None, world: World) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class _Plan:
    """What every rank learns from rank 0's plan."""

    run_id: str
    root: str  # where the scan's images are read from
    header: dict[str, Any]  # the manifest's, stored in every shard (Manifest.header)
    images: int
    captions: int
    reused_images: int
    reused_captions: int
    rows: int  # the scan table's, that each rank reads its own rows from
    extra_captions: list[str]  # the empty caption and the validation prompts (Captions.extra)


_Done = tuple[list[ShardInfo], Counters]  # one rank's finished shards and counts


def _prepare_manifest(opts: CacheOptions, config: CacheConfig, prompts: list[str] | None) -> Manifest:
    """The manifest with shards from an interrupted run folded in; refuses another config."""
    manifest = Manifest.load(opts.cache)
    entries, part_files = read_parts(opts.cache)
    changed = ", ".join(config.differences(manifest.config)) if manifest is not None else ""
    if changed:
        if not opts.force:
            raise InputError(
                f"{opts.cache} was made with another model or preprocessing ({changed} differ): "
                "use another --out, or --force to replace it"
            )
        log.warning("--force: replacing the cache at %s (made with another config)", opts.cache)
        manifest, entries = None, []  # the old shards are unlisted now, and removed below
    if manifest is None:
        manifest = Manifest.new(config)
    if prompts is not None:
        manifest.validation_prompts = prompts
    manifest.merge(entries)
    manifest.save(opts.cache)
    remove_parts(part_files)
    _remove_unlisted(opts.cache, {s["name"] for s in manifest.shards})
    return manifest


def _remove_unlisted(cache: str, listed: set[str]) -> None:
    """Shards a killed run wrote but never listed: their samples are redone. (Its .tmp files are
    the shard writers' to remove: only they know whether a live run still writes one.)"""
    shards = storage.join(cache, "shards")
    if not storage.is_s3(cache) and not storage.exists(shards):
        return
    for info in storage.list_files(shards):
        if "/" not in info.key and not info.key.endswith(STAGED_SUFFIX) and info.key not in listed:
            log.info("removing %s: not listed in the manifest (left by an interrupted run)", info.key)
            storage.delete(info.location)


def _rank_failure(exc: Exception, cache: str, world: World) -> Exception:
    """What a rank's failure is reported as: disk failures as their StkError, naming the rank."""
    where = f"rank {world.rank} on {world.node}"
    failure = as_stk_error(exc, where=where)
    if failure is None and isinstance(exc, OSError):
        failure = InputError(f"{where}: cannot write the cache {cache}: {exc.strerror or exc}")
    return failure or exc


def _check_errors(opts: CacheOptions, errors: list[dict[str, Any]], images: int, root: str) -> None:
    """Exit 4 past --max-errors: a scan read from the wrong place must not pass as a cache."""
    check_max_errors(
        opts.max_errors,
        Counter(e["kind"] for e in errors),
        images,
        f"of {images} images could not be cached",
        storage.join(opts.cache, ERRORS),
        f"the images are read from {root or 'the paths in the scan'}; the finished shards were kept",
    )


def _check_alignment(opts: CacheOptions, buckets: dict[str, Any]) -> None:
    """The scan's buckets with images are sizes the model's family trains on (read from its configs only)."""
    family = opts.family or detect_family(opts.model)
    sizes = [(b["width"], b["height"]) for b in buckets.get("buckets", []) if b.get("count", 1)]
    fix = f"scan again with stk-scan --family {family.value}"
    check_aligned(sizes, model_alignment(opts.model, family), family, f"{opts.scan_dir}: bucket", fix)


def _check_inputs(opts: CacheOptions) -> ScanRows:
    """What needs no model weights, checked before they load (minutes with FLUX): the scan table and its
    buckets readable, the cache location writable (on S3: the bucket there, the endpoint S3), its
    manifest readable, and then, from the model's configs, its family able to train the buckets. Returns the
    scan table opened to be read a batch of rows at a time."""
    scan = ScanRows(opts.scan_dir)
    buckets = read_buckets(opts.scan_dir)
    storage.check_writable(opts.cache)
    Manifest.load(opts.cache)
    _check_alignment(opts, buckets)
    return scan


def _plan(
    opts: CacheOptions, scan: ScanRows, config: CacheConfig, encoders: Encoders, prompts: list[str] | None, world: World
) -> tuple[_Plan, list[RowShare]]:
    manifest = _prepare_manifest(opts, config, prompts)
    texts = config.text_recipe()
    jobs, row_keys, row_texts = read_keys(scan, config.latent_recipe(), texts)
    done_latents, done_texts = cached_keys(opts.cache, manifest)
    todo_rows = np.flatnonzero(~held(row_keys, done_latents)) if len(done_latents) else np.arange(len(jobs))
    del row_keys  # each row's keys are dropped once used: the ranks key their own rows again
    # stk-train's extra captions, keyed like any: the empty one (--caption-dropout, guidance) and the prompts
    extra = [EMPTY_CAPTION, *manifest.validation_prompts]
    captions = distinct_captions(row_texts, extra, texts)
    del row_texts
    todo = jobs.take(todo_rows) if len(todo_rows) < len(jobs) else jobs
    todo_captions = captions.take(np.flatnonzero(~held(captions.key, done_texts))) if len(done_texts) else captions
    lat_order, lat_bounds = latent_batches(todo, opts.batch_size)
    tokens = token_counts(encoders.text, todo_captions, scan)
    txt_order, txt_bounds = text_batches(todo_captions.key, tokens, opts.text_batch_size)
    lat_owner = assign(batch_sums(todo.pixels[lat_order], lat_bounds), world.size)
    txt_owner = assign(text_costs(tokens[txt_order], txt_bounds), world.size)
    log.info(
        "%d images (%d cached), %d distinct captions (%d cached): %d + %d batches on %d rank(s)",
        len(jobs),
        len(jobs) - len(todo),
        len(captions),
        len(captions) - len(todo_captions),
        len(lat_bounds) - 1,
        len(txt_bounds) - 1,
        world.size,
    )
    plan = _Plan(
        run_id=uuid.uuid4().hex[:8],
        root=scan.root,
        header=manifest.header(),
        images=len(jobs),
        captions=len(captions),
        reused_images=len(jobs) - len(todo),
        reused_captions=len(captions) - len(todo_captions),
        rows=len(jobs),
        extra_captions=extra,
    )
    shares: list[RowShare] = []
    for lats, txts in zip(lat_owner, txt_owner, strict=True):
        rows, bounds = owned(lat_order, lat_bounds, lats)
        text_rows, text_bounds = owned(txt_order, txt_bounds, txts)
        shares.append((todo_rows[rows], bounds, todo_captions.source[text_rows], text_bounds))
    return plan, shares


def _load(opts: CacheOptions, world: World) -> tuple[Encoders, CacheConfig]:
    """The encoders on this rank's device, or with --two-pass on the CPU until their pass (in the dtype of the
    device: the same weights, so the same `Encoders.config()` and interchangeable caches); refused in one line
    when they cannot fit the device, before or while they load."""
    device = _device(opts.device, world)
    dtype = compute_dtype(device)
    need = check_fits(opts.model, device, dtype, opts.two_pass, world.local_size)
    try:
        encoders = load_encoders(opts.model, opts.family, torch.device("cpu") if opts.two_pass else device, dtype)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise load_failure(opts.model, device, need, opts.two_pass) from exc
        raise
    buckets = CacheConfig.scan_buckets(read_buckets(opts.scan_dir))
    # CacheConfig records the latents as the family's example stores them where --latents is not given
    return encoders, CacheConfig(encoders.family.value, encoders.config(), opts.settings, buckets, encoders.norm)


def _encode_share(
    opts: CacheOptions, world: World, encoders: Encoders, config: CacheConfig, plan: _Plan, share: RowShare
) -> _Done:
    """This rank's batches into its own shards, each recorded in its part file once finished."""
    latent, text = rank_share(opts.scan_dir, config, plan.rows, plan.extra_captions, share)
    writer_name = f"{plan.run_id}-r{world.rank:05d}"
    recorder = PartRecorder(opts.cache, writer_name)
    counters = Counters()
    total = len(latent) + len(text)
    work_dir = local_work_dir(opts.cache, world.rank)
    writer = ShardWriter(opts.cache, work_dir, writer_name, opts.shard_size, recorder, plan.header)
    device = _device(opts.device, world)
    with Progress(world, total=total, unit="sample", desc=f"cache (rank 0 of {world.size})") as progress:
        if opts.two_pass:
            encoders.place(text=device, vae=torch.device("cpu"))
        with measured(device) as counters.text:
            encode_texts(encoders, text.batches(), writer, config.settings, counters, progress.update)
        log.info(
            "text pass: %d captions in %.1f s (%.1f captions/s), peak %.2f GiB (%s)",
            counters.captions,
            counters.text.seconds,
            counters.captions / max(counters.text.seconds, 1e-9),
            counters.text.peak_bytes / 2**30,
            counters.text.peak_of,
        )
        if opts.two_pass:
            _vae_pass(encoders, device)
        encode_latents(encoders, latent.batches(), writer, config.settings, opts.threads, counters, progress.update)
    writer.close()
    return recorder.finished, counters


def _vae_pass(encoders: Encoders, device: torch.device) -> None:
    """--two-pass: the text encoders' weights dropped (device and host), then the VAE onto the device."""
    encoders.place(text=torch.device("meta"), vae=device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("text encoders released; the VAE is on %s for the images", device)


def _list_shards(opts: CacheOptions, config: CacheConfig, done: list[_Done]) -> list[ShardInfo]:
    """Every rank's finished shards into the manifest; the part files that recorded them go."""
    manifest = Manifest.load(opts.cache) or Manifest.new(config)
    infos = [info for finished, _ in done for info in finished]
    manifest.merge(shard_entry(info) for info in infos)
    manifest.save(opts.cache)
    remove_parts(read_parts(opts.cache)[1])
    for rank, (finished, c) in enumerate(done):
        log.info(
            "rank %d: %d images, %d captions (%.1f s, peak %.2f GiB), %d errors, %d shard(s), %.1f MiB",
            rank,
            c.images,
            c.captions,
            c.text.seconds,
            c.text.peak_bytes / 2**30,
            len(c.errors),
            len(finished),
            sum(i.bytes for i in finished) / 2**20,
        )
    return infos


def _finish(
    opts: CacheOptions, world: World, config: CacheConfig, plan: _Plan, done: list[_Done], started: float
) -> CacheSummary:
    infos = _list_shards(opts, config, done)
    errors = [e for _, c in done for e in c.errors]
    storage.write_atomic(storage.join(opts.cache, ERRORS), to_json_lines(errors).encode())
    seconds = time.monotonic() - started
    encoded = sum(c.images for _, c in done)
    captions = sum(c.captions for _, c in done)
    text_seconds = max(c.text.seconds for _, c in done)
    summary = CacheSummary(
        cache=opts.cache,
        model=opts.model,
        family=config.family,
        images=plan.images,
        captions=plan.captions,
        encoded_images=encoded,
        encoded_captions=captions,
        reused_images=plan.reused_images,
        reused_captions=plan.reused_captions,
        errors=len(errors),
        shards_written=len(infos),
        bytes_written=sum(i.bytes for i in infos),
        ranks=world.size,
        seconds=round(seconds, 3),
        images_per_second=round(encoded / seconds, 2) if seconds > 0 else 0.0,
        captions_per_second=round(captions / text_seconds, 2) if text_seconds > 0 else 0.0,
        text_peak_memory_gib=round(max(c.text.peak_bytes for _, c in done) / 2**30, 3),
        text_peak_memory_of=done[0][1].text.peak_of,
        two_pass=opts.two_pass,
    )
    log.info(summary.line())
    _check_errors(opts, errors, plan.images, plan.root)
    return summary


def run_cache(opts: CacheOptions, world: World) -> CacheSummary:
    """Encode every scan row's latent and caption embedding not cached yet, on every rank of `world`.

    Planning and listing happen on rank 0 only, so the manifest has one writer; the batches do not
    depend on the rank count, so 1 and N ranks write the same tensors. A rerun after a kill keeps
    every finished shard and encodes only the rest. One run per cache directory: rank 0 holds its
    lease (stk/cluster/lease.py) from before anything is written there until the manifest lists the shards."""
    started = time.monotonic()
    parse_max_errors(opts.max_errors, 0)  # a bad value fails now, not after the encoding
    file = opts.validation_prompts
    prompts = world.run_everywhere(lambda: read_prompts(file) if file else None)  # before any model loads
    with leased(cache_lease(opts.cache), world):
        scans: list[ScanRows] = []  # rank 0's: opened once, planned from after the model loads
        world.root_call(lambda: scans.append(_check_inputs(opts)))
        encoders, config = world.run_everywhere(lambda: _load(opts, world))
        return split_work(
            world,
            lambda: _plan(opts, scans.pop(), config, encoders, prompts, world),  # not kept while encoding
            lambda plan, share: _encode_share(opts, world, encoders, config, plan, share),
            lambda plan, done: _finish(opts, world, config, plan, done, started),
            # a disk failure as its StkError naming the rank; nothing unfinished is listed
            lambda exc: _rank_failure(exc, opts.cache, world),
        )
