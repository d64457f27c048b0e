"""What a run trains on, settled before any model loads: the data source (cache or images), the
keys per bucket, each bucket's repeats, and how latents are normalised for the denoiser."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stk.buckets import effective_batch_size
from stk.errors import InputError
from stk.models import Family, detect_family
from stk.models.alignment import check_aligned
from stk.models.families import spec_for
from stk.models.latents import LatentNorm
from stk.models.model_json import vae_scale_factor
from stk.shards.jobs import expected_columns
from stk.train.data import CacheData, ImageData, TrainData
from stk.train.options import TrainOptions
from stk.train.preflight import check_buckets, check_coverage, scan_repeats

__all__ = ["TrainPlan", "plan_training"]

_RESCAN = "scan again with stk-scan --family {family} and cache again"

BucketShape = tuple[int, int]


@dataclass
class TrainPlan:
    family: Family
    data: TrainData
    buckets: dict[BucketShape, np.ndarray]  # latent (h, w) -> keys (bytes, sorted)
    repeats: dict[BucketShape, int]
    norm: LatentNorm | None  # None with --vae-on-the-fly: the VAE's own, once it loads (Encoders.norm)
    vae_scale_factor: int


def plan_training(opts: TrainOptions, world_size: int) -> TrainPlan:
    family = Family(opts.family) if opts.family else detect_family(opts.model)
    factor = vae_scale_factor(opts.model)
    if opts.vae_on_the_fly:
        check_text_encoders_in_train(family, "--vae-on-the-fly encodes the captions as it trains")
        data, buckets, norm = _from_images(opts, factor)
    else:
        data, buckets, norm = _from_cache(opts, family)
    try:
        if not any(len(keys) for keys in buckets.values()):
            raise InputError("nothing to train on: the cache (or scan) holds no samples")
        sizes = ((w * factor, h * factor) for (h, w), keys in buckets.items() if len(keys))
        check_aligned(sizes, spec_for(family).alignment(factor), family, "bucket", _RESCAN.format(family=family.value))
        ids, repeats = _repeats(opts, buckets, factor)
        effective = effective_batch_size(opts.batch_size, world_size, opts.grad_accum)
        repeats = check_buckets(buckets, repeats, effective, factor, opts.allow_oversubscription, ids)
    except BaseException:
        data.close()
        raise
    return TrainPlan(family, data, buckets, repeats, norm, factor)


def check_text_encoders_in_train(family: Family, why: str) -> None:
    """InputError where the family's text encoders are loaded by stk-cache only (`text_encoders_in_train`)."""
    spec = spec_for(family)
    if not spec.text_encoders_in_train:
        raise InputError(
            f"{why}, but stk-train does not load {spec.title}'s text encoder (an LLM of billions of parameters): "
            "encode the captions and prompts with stk-cache (--validation-prompts FILE adds prompts to a cache)"
        )


def _from_images(opts: TrainOptions, factor: int) -> tuple[TrainData, dict[BucketShape, np.ndarray], None]:
    if not opts.scan:
        raise InputError("--vae-on-the-fly trains from the scan table and its images: give --scan")
    data = ImageData(opts.scan, factor, seed=opts.seed)
    return data, data.bucket_keys(), None


def _from_cache(opts: TrainOptions, family: Family) -> tuple[TrainData, dict[BucketShape, np.ndarray], LatentNorm]:
    if not opts.cache:
        raise InputError("give --cache (made by stk-cache), or --vae-on-the-fly with --scan")
    data = CacheData(
        opts.cache,
        local_dir=opts.local_cache_dir,
        max_local_bytes=opts.local_cache_bytes,
        check_sha256=opts.check_shards,
    )
    try:
        if data.config.family != family.value:
            raise InputError(
                f"{opts.cache} was made for a {data.config.family} model, but {opts.model} is {family.value}: "
                "cache with the model you train"
            )
        buckets = data.bucket_keys()
        if opts.scan:
            buckets = _covered(opts.cache, opts.scan, data, buckets)
    except BaseException:
        data.close()
        raise
    return data, buckets, data.config.norm


def _covered(
    cache: str, scan: str, data: CacheData, buckets: dict[BucketShape, np.ndarray]
) -> dict[BucketShape, np.ndarray]:
    """The scan's rows only (a cache may hold more), after checking the cache has all of them."""
    jobs, _ = expected_columns(cache, data.config, scan)
    cached = np.concatenate(list(buckets.values())) if buckets else np.zeros(0, "S1")
    missing = jobs.path.take(np.flatnonzero(~np.isin(jobs.key, cached))).to_pylist()
    missing_texts = len(np.setdiff1d(jobs.text_key, data.reader.text_key_array()))
    check_coverage(missing, missing_texts, cache, scan)
    wanted = {hw: np.isin(keys, jobs.key) for hw, keys in buckets.items()}
    return {hw: keys[wanted[hw]] for hw, keys in buckets.items() if wanted[hw].any()}


def _repeats(
    opts: TrainOptions, buckets: dict[BucketShape, np.ndarray], factor: int
) -> tuple[dict[BucketShape, int] | None, dict[BucketShape, int]]:
    """Bucket ids (the scan's, for messages) and repeats: --repeats for all, else the scan's, else 1."""
    from_scan = scan_repeats(opts.scan, factor) if opts.scan else {}
    ids = {hw: from_scan[hw][0] for hw in buckets if hw in from_scan} if from_scan else None
    if ids is not None and len(ids) != len(buckets):
        ids = None  # latent shapes the scan's buckets do not explain: number them ourselves
    if opts.repeats is not None:
        return ids, {hw: opts.repeats for hw in buckets}
    return ids, {hw: from_scan[hw][1] if hw in from_scan else 1 for hw in buckets}
