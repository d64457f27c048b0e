"""stk.train.data.plan with a combined scan of two datasets, written here as `stk-scan --datasets` writes one (each
row's `dataset`, full paths and an empty root, per-dataset buckets with their own repeats, the "datasets" list): each
row's key in its dataset's group, the repeats of each dataset's buckets, the weights, the datasets a checkpoint records,
and a short bucket or an unlisted dataset refused naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stk.errors import BatchCheckFailed, CacheIncomplete
from stk.shards.jobs import read_jobs
from stk.train.data.datasets import run_datasets
from stk.train.data.plan import _scan_groups, plan_training
from stk.train.data.sampler import BucketSampler
from stk.train.options import TrainOptions

STYLE = [f"/data/style/s{i}.png" for i in range(3)] + ["/data/photos/p0.png"]  # one image in both datasets
PHOTOS = [f"/data/photos/p{i}.png" for i in range(6)]
WIDE = [f"/data/photos/w{i}.png" for i in range(4)]  # 96x64 px


def combined_scan(out: Path, weighted: bool = False, unlisted: bool = False) -> Path:
    """Dataset "style" (4 images at 64x64, repeats 10, caption dropout 0.2) and "photos" (6 at 64x64, 4 at 96x64)."""
    rows = [("style", p, 64) for p in STYLE] + [("photos", p, 64) for p in PHOTOS] + [("photos", p, 96) for p in WIDE]
    if unlisted:
        rows.append(("other", "/data/other/o0.png", 64))
    out.mkdir(parents=True)
    table = {
        "path": [p for _, p, _ in rows],
        "caption": [f"a picture of {p}" for _, p, _ in rows],
        "bucket_width": pa.array([w for _, _, w in rows], pa.int32()),
        "bucket_height": pa.array([64] * len(rows), pa.int32()),
        "bytes": [1000 + len(p) for _, p, _ in rows],
        "mtime": [1.7e9] * len(rows),
        "dataset": [d for d, _, _ in rows],
    }
    pq.write_table(pa.table(table), out / "metadata.parquet")
    buckets = [
        {"id": 0, "width": 64, "height": 64, "count": 4, "repeats": 10, "dataset": "style"},
        {"id": 1, "width": 64, "height": 64, "count": 6, "repeats": 1, "dataset": "photos"},
        {"id": 2, "width": 96, "height": 64, "count": 4, "repeats": 1, "dataset": "photos"},
    ]
    datasets: list[dict[str, Any]] = [
        {
            "name": "style",
            "source": "/data/style",
            "repeats": 10,
            "weight": 3.0 if weighted else None,
            "crop": None,
            "caption_dropout": 0.2,
            "resolution": 64,
            "resolution_type": "pixel_area",
            "images": 4,
            "buckets": [0],
        },
        {
            "name": "photos",
            "source": "/data/photos",
            "repeats": 1,
            "weight": None,
            "crop": "center",
            "caption_dropout": None,
            "resolution": 64,
            "resolution_type": "pixel_area",
            "images": 10,
            "buckets": [1, 2],
        },
    ]
    document = {"buckets": buckets, "datasets": datasets, "weighted": weighted}
    (out / "buckets.json").write_text(json.dumps(document))
    (out / "summary.json").write_text(json.dumps({"root": "", "rows": len(rows)}))
    return out


def opts(model: Path, scan: Path, tmp_path: Path, batch_size: int = 2) -> TrainOptions:
    return TrainOptions(str(model), str(tmp_path / "run"), scan=str(scan), vae_on_the_fly=True, batch_size=batch_size)


def paths(names: list[str]) -> np.ndarray:
    return np.array(sorted(name.encode() for name in names))


@pytest.mark.parametrize("weighted", [False, True])
def test_a_combined_scan_plans_a_group_per_dataset_and_bucket_with_its_repeats(sdxl, tmp_path, weighted):
    scan = combined_scan(tmp_path / "scan", weighted)
    plan = plan_training(opts(sdxl, scan, tmp_path), world_size=2)  # effective batch 4: every bucket fills one
    assert {g: keys.tolist() for g, keys in plan.groups.items()} == {
        ("style", 8, 8): paths(STYLE).tolist(),
        ("photos", 8, 8): paths(PHOTOS).tolist(),
        ("photos", 8, 12): paths(WIDE).tolist(),
    }
    assert plan.repeats == {("style", 8, 8): 10, ("photos", 8, 8): 1, ("photos", 8, 12): 1}
    assert [(d.name, d.repeats, d.caption_dropout) for d in plan.datasets] == [("style", 10, 0.2), ("photos", 1, None)]
    assert plan.weights == ({"style": 3.0, "photos": 1.0} if weighted else None)  # no weight given: 1.0
    recorded = plan.run_settings(opts(sdxl, scan, tmp_path), 2)["datasets"]
    assert recorded == [
        {"name": "style", "repeats": 10, "weight": 3.0 if weighted else None, "caption_dropout": 0.2},
        {"name": "photos", "repeats": 1, "weight": 1.0 if weighted else None, "caption_dropout": None},
    ]
    sampler = BucketSampler(plan.groups, plan.repeats, 2, 2, 0, weights=plan.weights)
    assert sampler.steps_per_epoch == 40 // 4 + 6 // 4 + 4 // 4  # style's 4 images x 10, photos' once


def test_a_short_bucket_is_refused_naming_its_dataset(sdxl, tmp_path):
    scan = combined_scan(tmp_path / "scan")
    with pytest.raises(BatchCheckFailed) as failed:
        plan_training(opts(sdxl, scan, tmp_path, batch_size=3), world_size=2)  # effective batch 6
    lines = str(failed.value).splitlines()
    assert "  dataset 'photos', bucket 2 (96x64): 4 images, 4 samples; needs --repeats >= 2" in lines
    assert not any("bucket 0" in line or "bucket 1" in line for line in lines)  # style's 40, photos' 6 samples


def test_rows_of_a_dataset_the_list_lacks_are_damage(sdxl, tmp_path):
    scan = combined_scan(tmp_path / "scan", unlisted=True)
    with pytest.raises(CacheIncomplete, match=r"its dataset other is not in buckets\.json"):
        plan_training(opts(sdxl, scan, tmp_path), world_size=1)


def test_a_cache_s_buckets_split_by_the_datasets_of_the_scan_rows(tmp_path):
    """The cache path: the covered buckets' latent keys, each in the groups of the datasets whose rows have it."""
    scan = combined_scan(tmp_path / "scan")
    jobs = read_jobs(str(scan), {"recipe": 1}, {})
    height, width = jobs.bucket_height // 8, jobs.bucket_width // 8
    buckets = {(8, 8): np.unique(jobs.key[width == 8]), (8, 12): np.unique(jobs.key[width == 12])}
    datasets = run_datasets(json.loads((scan / "buckets.json").read_text()), "buckets.json")
    groups = _scan_groups(datasets, buckets, jobs)
    rows = {name: jobs.key[: len(STYLE)] if name == "style" else jobs.key[len(STYLE) :] for name in ("style", "photos")}
    assert set(groups) == {("style", 8, 8), ("photos", 8, 8), ("photos", 8, 12)} and len(height) == 14
    assert groups[("style", 8, 8)].tolist() == sorted(rows["style"].tolist())
    assert groups[("photos", 8, 8)].tolist() + groups[("photos", 8, 12)].tolist() == sorted(
        rows["photos"][: len(PHOTOS)].tolist()
    ) + sorted(rows["photos"][len(PHOTOS) :].tolist())
    shared = jobs.key[len(STYLE) - 1]  # p0 in both datasets: the same latent in both groups
    assert shared in groups[("style", 8, 8)] and shared in groups[("photos", 8, 8)]
