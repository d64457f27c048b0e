"""The cache across ranks: plan on rank 0 (what is done, what to encode, who encodes it),
encode on every rank into its own shards, then list the shards in the manifest on rank 0."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from stk import storage
from stk.cache.encode import Counters, EncodeSettings, encode_latents, encode_texts
from stk.cache.keys import digest
from stk.cache.parts import PartRecorder, read_parts, remove_parts, shard_entry
from stk.cache.plan import ImageJob, assign, jobs_for, latent_batches, load_scan, local_work_dir, text_batches
from stk.errors import InputError, check_max_errors, parse_max_errors
from stk.log import get_logger
from stk.metadata import to_json_lines
from stk.models import Encoders, Family, load_encoders
from stk.progress import Progress
from stk.shards import CacheReader, Manifest, ShardWriter
from stk.shards.staging import STAGED_SUFFIX
from stk.storage.failures import as_stk_error
from stk.world import World

__all__ = ["CacheOptions", "CacheSummary", "run_cache"]

log = get_logger("cache")


@dataclass
class CacheOptions:
    scan_dir: str
    model: str
    cache: str
    family: Family | None = None
    device: str | None = None
    batch_size: int = 16
    text_batch_size: int = 64
    shard_size: int = 512 * 1024 * 1024
    threads: int = 4
    settings: EncodeSettings = field(default_factory=EncodeSettings)
    force: bool = False
    max_errors: str = "1%"  # as stk-scan's: a count, or a percentage of the scan's images


@dataclass
class CacheSummary:
    cache: str
    model: str
    family: str
    images: int  # scan rows
    captions: int  # distinct captions
    encoded_images: int
    encoded_captions: int
    reused_images: int
    reused_captions: int
    errors: int
    shards_written: int
    bytes_written: int
    ranks: int
    seconds: float
    images_per_second: float

    def line(self) -> str:
        return (
            f"{self.images} images, {self.captions} distinct captions: encoded {self.encoded_images} images and "
            f"{self.encoded_captions} captions ({self.reused_images} + {self.reused_captions} already cached), "
            f"{self.errors} errors, {self.shards_written} shards ({self.bytes_written / 2**20:.1f} MiB) in "
            f"{self.seconds:.1f} s ({self.images_per_second:.1f} images/s on {self.ranks} rank(s))"
        )


def _device(requested: str | None, world: World) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def cache_config(encoders: Encoders, opts: CacheOptions, scan_dir: str) -> dict[str, Any]:
    """Everything that makes two caches interchangeable; a cache is never extended under another."""
    model = encoders.config()
    settings = asdict(opts.settings)
    settings["crop"] = opts.settings.crop.value
    try:
        buckets = json.loads(storage.read_bytes(storage.join(scan_dir, "buckets.json")))
    except FileNotFoundError:
        raise InputError(f"{scan_dir}: no buckets.json (not an stk-scan output; run stk-scan first)") from None
    return {
        "family": encoders.family.value,
        "model": model,
        "latents": {k: settings[k] for k in ("crop", "store_logvar", "dtype")},
        "text": {k: settings[k] for k in ("trim_padding", "dtype")},
        "buckets": {k: buckets.get(k) for k in ("resolution", "resolution_type", "alignment")},
        "scaling_factor": encoders.scaling_factor,
        "shift_factor": encoders.shift_factor,
    }


def latent_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """What a latent depends on besides its image: the VAE and how latents are stored."""
    return {"vae": digest(config["model"]["vae"]), "latents": config["latents"]}


def text_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """What an embedding depends on besides its caption: the text encoders and the stored form."""
    return {"encoders": digest(config["model"]["text"]), "text": config["text"]}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


@dataclass
class _Plan:
    latent: list[list[list[ImageJob]]]  # per rank
    text: list[list[list[tuple[str, str]]]]  # per rank
    run_id: str
    root: str  # where the scan's images are read from
    images: int
    captions: int
    reused_images: int
    reused_captions: int


def _prepare_manifest(opts: CacheOptions, config: dict[str, Any]) -> Manifest:
    """The manifest with shards from an interrupted run folded in; refuses another config."""
    manifest = Manifest.load(opts.cache)
    entries, part_files = read_parts(opts.cache)
    if manifest is not None and manifest.config != config:
        if not opts.force:
            changed = ", ".join(_differences(manifest.config, config))
            raise InputError(
                f"{opts.cache} was made with another model or preprocessing ({changed} differ): "
                "use another --out, or --force to replace it"
            )
        log.warning("--force: replacing the cache at %s (made with another config)", opts.cache)
        manifest, entries = None, []  # the old shards are unlisted now, and removed below
    if manifest is None:
        manifest = Manifest(config=config, shards=[], scaling_factor=config["scaling_factor"])
    listed = {s["name"] for s in manifest.shards}
    manifest.shards.extend(e for e in entries if e["name"] not in listed)
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
        storage.join(opts.cache, "errors.jsonl"),
        f"the images are read from {root or 'the paths in the scan'}; the finished shards were kept",
    )


def _plan(opts: CacheOptions, config: dict[str, Any], world: World) -> _Plan:
    scan = load_scan(opts.scan_dir)
    manifest = _prepare_manifest(opts, config)
    done_latents: set[str] = set()
    done_texts: set[str] = set()
    if manifest.shards:
        reader = CacheReader(opts.cache)
        done_latents, done_texts = set(reader.latent_keys()), set(reader.text_keys())
        reader.close()
    jobs = jobs_for(scan, latent_recipe(config), text_recipe(config))
    captions = {job.text_key: job.caption for job in jobs}
    todo_jobs = [job for job in jobs if job.key not in done_latents]
    todo_captions = {k: c for k, c in captions.items() if k not in done_texts}
    lat = latent_batches(todo_jobs, opts.batch_size)
    txt = text_batches(todo_captions, opts.text_batch_size)
    lat_owner = assign([sum(j.pixels for j in b) for b in lat], world.size)
    txt_owner = assign([len(b) for b in txt], world.size)
    log.info(
        "%d images (%d cached), %d distinct captions (%d cached): %d + %d batches on %d rank(s)",
        len(jobs), len(jobs) - len(todo_jobs), len(captions), len(captions) - len(todo_captions),
        len(lat), len(txt), world.size,
    )  # fmt: skip
    return _Plan(
        latent=[[lat[i] for i in owned] for owned in lat_owner],
        text=[[txt[i] for i in owned] for owned in txt_owner],
        run_id=uuid.uuid4().hex[:8],
        root=scan.root,
        images=len(jobs),
        captions=len(captions),
        reused_images=len(jobs) - len(todo_jobs),
        reused_captions=len(captions) - len(todo_captions),
    )


def run_cache(opts: CacheOptions, world: World) -> CacheSummary:
    started = time.monotonic()
    parse_max_errors(opts.max_errors, 0)  # a bad value fails now, not after the encoding

    def load() -> tuple[Encoders, dict[str, Any]]:
        encoders = load_encoders(opts.model, opts.family, device=_device(opts.device, world))
        return encoders, cache_config(encoders, opts, opts.scan_dir)

    encoders, config = world.run_everywhere(load)
    kept: dict[str, Any] = {}

    def plan() -> tuple[str, int, int, int, int]:
        p = _plan(opts, config, world)
        kept["plan"] = p
        return p.run_id, p.images, p.captions, p.reused_images, p.reused_captions

    run_id, images, captions, reused_images, reused_captions = world.root_call(plan)
    mine_latent = world.scatter(kept["plan"].latent if world.is_root else None)
    mine_text = world.scatter(kept["plan"].text if world.is_root else None)

    writer_name = f"{run_id}-r{world.rank:05d}"
    recorder = PartRecorder(opts.cache, writer_name)
    counters = Counters()
    total = sum(len(b) for b in mine_latent) + sum(len(b) for b in mine_text)
    failure: Exception | None = None
    try:
        writer = ShardWriter(opts.cache, local_work_dir(opts.cache, world.rank), writer_name, opts.shard_size, recorder)
        with Progress(world, total=total, unit="sample", desc=f"cache (rank 0 of {world.size})") as progress:
            encode_texts(encoders, mine_text, writer, opts.settings, counters, progress.update)
            encode_latents(encoders, mine_latent, writer, opts.settings, opts.threads, counters, progress.update)
        writer.close()
    except Exception as exc:  # reported through the gather so that no rank waits forever; nothing unfinished is listed
        failure = _rank_failure(exc, opts.cache, world)
    gathered = world.gather((recorder.finished, counters, failure))

    def finish() -> CacheSummary:
        assert gathered is not None
        for _, _, exc in gathered:
            if exc is not None:
                raise exc
        manifest = Manifest.load(opts.cache) or Manifest(config, [], config["scaling_factor"])
        infos = [info for finished, _, _ in gathered for info in finished]
        listed = {s["name"] for s in manifest.shards}
        manifest.shards.extend(shard_entry(i) for i in infos if i.name not in listed)
        manifest.save(opts.cache)
        remove_parts(read_parts(opts.cache)[1])
        for rank, (finished, c, _) in enumerate(gathered):
            log.info(
                "rank %d: %d images, %d captions, %d errors, %d shard(s), %.1f MiB",
                rank, c.images, c.captions, len(c.errors), len(finished), sum(i.bytes for i in finished) / 2**20,
            )  # fmt: skip
        errors = [e for _, c, _ in gathered for e in c.errors]
        storage.write_atomic(storage.join(opts.cache, "errors.jsonl"), to_json_lines(errors).encode())
        seconds = time.monotonic() - started
        encoded = sum(c.images for _, c, _ in gathered)
        summary = CacheSummary(
            cache=opts.cache,
            model=opts.model,
            family=encoders.family.value,
            images=images,
            captions=captions,
            encoded_images=encoded,
            encoded_captions=sum(c.captions for _, c, _ in gathered),
            reused_images=reused_images,
            reused_captions=reused_captions,
            errors=len(errors),
            shards_written=len(infos),
            bytes_written=sum(i.bytes for i in infos),
            ranks=world.size,
            seconds=round(seconds, 3),
            images_per_second=round(encoded / seconds, 2) if seconds > 0 else 0.0,
        )
        log.info(summary.line())
        _check_errors(opts, errors, images, kept["plan"].root)
        return summary

    return world.root_call(finish)
