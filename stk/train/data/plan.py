"""What a run trains on, settled before any model loads: the data source (cache or images), the keys of each group
(a dataset's latent shape: stk.train.data.sampler), each group's repeats, the datasets (a combined scan's), and how
latents are normalised for the denoiser.

Without --scan, or with the scan of one source, every key belongs to the one dataset "". With a combined scan
(buckets.json lists "datasets") each scan row's dataset (its `dataset` column) puts its key in that dataset's group;
a multi-dataset cache trained without --scan trains as one dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stk.buckets import effective_batch_size
from stk.errors import InputError
from stk.models import Family, detect_family
from stk.models.alignment import check_aligned
from stk.models.families import spec_for
from stk.models.latents import LatentNorm
from stk.models.model_json import vae_scale_factor
from stk.scan.outputs import BUCKETS, METADATA
from stk.scan.reader import read_buckets, read_scan_columns, row_datasets
from stk.shards.jobs import DATASET, ImageJobs, expected_columns
from stk.storage import join
from stk.train.data.datasets import DATASETS, RunDataset, dataset_settings, run_datasets, weights_of
from stk.train.data.loader import CacheData, ImageData, TrainData
from stk.train.data.sampler import Group
from stk.train.options import TrainOptions
from stk.train.preflight import check_buckets, check_coverage, scan_repeats

__all__ = ["TrainPlan", "plan_training"]

_RESCAN = "scan again with stk-scan --family {family} and cache again"

BucketShape = tuple[int, int]


@dataclass
class TrainPlan:
    family: Family
    data: TrainData
    groups: dict[Group, np.ndarray]  # (dataset, latent h, latent w) -> keys (bytes, sorted)
    repeats: dict[Group, int]
    norm: LatentNorm | None  # None with --vae-on-the-fly: the VAE's own, once it loads (Encoders.norm)
    vae_scale_factor: int
    datasets: list[RunDataset] = field(default_factory=list)  # a combined scan's; [] for one source

    @property
    def weights(self) -> dict[str, float] | None:
        """Dataset -> weight for the sampler's draw; None: an epoch by repeats."""
        return weights_of(self.datasets)

    def run_settings(self, opts: TrainOptions, world_size: int) -> dict[str, Any]:
        """What a checkpoint records and a resume compares: the options', and the datasets' where the scan lists
        them (a run of one source records what it always did)."""
        settings = opts.run_settings(self.family, world_size)
        return {**settings, DATASETS: dataset_settings(self.datasets)} if self.datasets else settings


def plan_training(opts: TrainOptions, world_size: int) -> TrainPlan:
    family = Family(opts.family) if opts.family else detect_family(opts.model)
    factor = vae_scale_factor(opts.model)
    document = read_buckets(opts.scan) if opts.scan else {}
    datasets = run_datasets(document, join(opts.scan, BUCKETS)) if opts.scan else []
    if opts.vae_on_the_fly:
        check_text_encoders_in_train(family, "--vae-on-the-fly encodes the captions as it trains")
        data, groups, norm = _from_images(opts, factor, datasets)
    else:
        data, groups, norm = _from_cache(opts, family, datasets)
    try:
        if not any(len(keys) for keys in groups.values()):
            raise InputError("nothing to train on: the cache (or scan) holds no samples")
        sizes = ((w * factor, h * factor) for (_, h, w), keys in groups.items() if len(keys))
        check_aligned(
            sizes, spec_for(family).latents.alignment(factor), family, "bucket", _RESCAN.format(family=family.value)
        )
        ids, repeats = _repeats(opts, document, groups, factor)
        effective = effective_batch_size(opts.batch_size, world_size, opts.grad_accum)
        repeats = check_buckets(groups, repeats, effective, factor, opts.allow_oversubscription, ids)
    except BaseException:
        data.close()
        raise
    return TrainPlan(family, data, groups, repeats, norm, factor, datasets)


def check_text_encoders_in_train(family: Family, why: str) -> None:
    """InputError where the family's text encoders are loaded by stk-cache only (`text_encoders_in_train`)."""
    spec = spec_for(family)
    if not spec.text.in_train:
        raise InputError(
            f"{why}, but stk-train does not load {spec.title}'s text encoder (an LLM of billions of parameters): "
            "encode the captions and prompts with stk-cache (--validation-prompts FILE adds prompts to a cache)"
        )


def _from_images(
    opts: TrainOptions, factor: int, datasets: list[RunDataset]
) -> tuple[TrainData, dict[Group, np.ndarray], None]:
    if not opts.scan:
        raise InputError("--vae-on-the-fly trains from the scan table and its images: give --scan")
    data = ImageData(opts.scan, factor, seed=opts.seed)
    buckets = data.bucket_keys()
    if not datasets:
        return data, _one_dataset(buckets), None
    rows, codes = data.bucket_rows(), _dataset_codes(opts.scan)
    return data, _split(datasets, buckets, lambda at, hw, keys: codes[rows[hw]] == at), None


def _from_cache(
    opts: TrainOptions, family: Family, datasets: list[RunDataset]
) -> tuple[TrainData, dict[Group, np.ndarray], LatentNorm]:
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
        groups = _one_dataset(buckets)
        if opts.scan:
            buckets, jobs = _covered(opts.cache, opts.scan, data, buckets)
            groups = _scan_groups(datasets, buckets, jobs)
    except BaseException:
        data.close()
        raise
    return data, groups, data.config.norm


def _one_dataset(buckets: dict[BucketShape, np.ndarray]) -> dict[Group, np.ndarray]:
    """Every bucket as the group of the one dataset ""."""
    return {("", h, w): keys for (h, w), keys in buckets.items()}


def _covered(
    cache: str, scan: str, data: CacheData, buckets: dict[BucketShape, np.ndarray]
) -> tuple[dict[BucketShape, np.ndarray], ImageJobs]:
    """The scan's rows only (a cache may hold more), after checking the cache has all of them; and those rows."""
    jobs, _ = expected_columns(cache, data.config, scan)
    cached = np.concatenate(list(buckets.values())) if buckets else np.zeros(0, "S1")
    missing = jobs.path.take(np.flatnonzero(~np.isin(jobs.key, cached))).to_pylist()
    missing_texts = len(np.setdiff1d(jobs.text_key, data.reader.text_key_array()))
    check_coverage(missing, missing_texts, cache, scan)
    wanted = {hw: np.isin(keys, jobs.key) for hw, keys in buckets.items()}
    return {hw: keys[wanted[hw]] for hw, keys in buckets.items() if wanted[hw].any()}, jobs


def _scan_groups(
    datasets: list[RunDataset], buckets: dict[BucketShape, np.ndarray], jobs: ImageJobs
) -> dict[Group, np.ndarray]:
    """The covered buckets split by the datasets of their scan rows (`jobs`: the rows the cache holds, each with its
    dataset): a key is in a dataset's group when one of the dataset's rows has it (the same image in two datasets is
    in both)."""
    if not datasets:
        return _one_dataset(buckets)
    keys_of = [np.unique(jobs.key[jobs.dataset == at]) for at in range(len(datasets))]
    return _split(datasets, buckets, lambda at, hw, keys: np.isin(keys, keys_of[at]))


def _dataset_codes(scan: str) -> np.ndarray:
    """Each scan row's dataset, as its place in buckets.json's "datasets" (the order of `run_datasets`)."""
    table, _ = read_scan_columns(scan, [DATASET])
    if DATASET not in table.column_names:
        raise InputError(f"{join(scan, METADATA)}: no {DATASET} column, but its {BUCKETS} lists datasets")
    return row_datasets(scan, table.column(DATASET).chunks)


def _split(
    datasets: list[RunDataset], buckets: dict[BucketShape, np.ndarray], member: Callable[..., np.ndarray]
) -> dict[Group, np.ndarray]:
    """Each bucket's keys per dataset: `member(place, hw, keys)` is the mask of the keys of dataset `place`."""
    groups = {}
    for at, dataset in enumerate(datasets):
        for (h, w), keys in buckets.items():
            mask = member(at, (h, w), keys)
            if mask.any():
                groups[(dataset.name, h, w)] = keys[mask]
    return groups


def _repeats(
    opts: TrainOptions, document: dict[str, Any], groups: dict[Group, np.ndarray], factor: int
) -> tuple[dict[Group, int] | None, dict[Group, int]]:
    """Bucket ids (the scan's, for messages) and repeats: --repeats for all, else the scan's, else 1."""
    from_scan = scan_repeats(document, opts.scan, factor) if opts.scan else {}
    ids = {g: from_scan[g][0] for g in groups if g in from_scan} if from_scan else None
    if ids is not None and len(ids) != len(groups):
        ids = None  # latent shapes the scan's buckets do not explain: number them ourselves
    if opts.repeats is not None:
        return ids, {g: opts.repeats for g in groups}
    return ids, {g: from_scan[g][1] if g in from_scan else 1 for g in groups}
