"""stk.shards.jobs on a scan of several datasets: a row is keyed under the recipe with its dataset's crop, the same
way by every reader (read_jobs, read_keys, expected_columns, expected_keys); a scan of one source keeps its keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.combined_scans import PHOTOS, STYLE, one_source, write_scan

from stk.errors import CacheIncomplete
from stk.images.preprocess import CropMode
from stk.models.latents import LatentNorm
from stk.scan.outputs import BUCKETS, METADATA
from stk.shards.config import CacheConfig, EncodeSettings
from stk.shards.jobs import ScanRows, expected_columns, expected_keys, read_jobs, read_keys
from stk.shards.keys import digest, latent_key

MODEL = {"vae": {"class": "AutoencoderKL"}, "text": {"encoders": []}}


def _config(crop: CropMode) -> CacheConfig:
    return CacheConfig("sd", MODEL, EncodeSettings(crop, store_logvar=False), {}, LatentNorm(0.18215))


def _recipe(crop: str) -> dict[str, Any]:
    """A latent recipe written out as stk-cache has always made it (what every existing cache's keys are under)."""
    return {"vae": digest(MODEL["vae"]), "latents": {"crop": crop, "store_logvar": False, "dtype": "float16"}}


def _rows(scan: Path) -> list[dict[str, Any]]:
    return pq.read_table(scan / METADATA).to_pylist()


def _all_keys(scan: Path, config: CacheConfig) -> list[list[str]]:
    """The rows' latent keys as each reader gives them: read_jobs, read_keys, expected_columns, expected_keys."""
    recipe, texts, cache = config.latent_recipe(), config.text_recipe(), str(scan / "no-cache")
    return [
        [job.key for job in read_jobs(str(scan), recipe, texts).rows()],
        [key.decode() for key in read_keys(ScanRows(str(scan)), recipe, texts)[1].tolist()],
        [key.decode() for key in expected_columns(cache, config, str(scan))[0].key.tolist()],
        [key.decode() for key in expected_keys(cache, config, ScanRows(str(scan)))[0].tolist()],
    ]


def test_a_row_is_keyed_under_its_datasets_crop_by_every_reader(tmp_path: Path) -> None:
    scan = write_scan(tmp_path)
    rows = _rows(scan)
    for cache_crop in CropMode:  # --crop
        readings = _all_keys(scan, _config(cache_crop))
        own = {STYLE: "random", PHOTOS: cache_crop.value}  # the photos give no crop: --crop
        assert all(keys == readings[0] for keys in readings)
        assert readings[0] == [latent_key(row, _recipe(own[row["dataset"]])) for row in rows]
    jobs = read_jobs(str(scan), _recipe("center"), {}).rows()
    assert [job.crop for job in jobs] == [CropMode.RANDOM if row["dataset"] == STYLE else None for row in rows]
    crop = ScanRows(str(scan)).crop  # an index into reader.CROPS: random; -1 for --crop
    assert crop is not None and crop.tolist() == [1 if row["dataset"] == STYLE else -1 for row in rows]


def test_a_scan_of_one_source_keeps_the_keys_it_always_had(tmp_path: Path) -> None:
    several = write_scan(tmp_path)
    scan = one_source(several)
    rows = _rows(scan)
    for crop in CropMode:
        expected = [latent_key(row, _recipe(crop.value)) for row in rows]
        assert all(keys == expected for keys in _all_keys(scan, _config(crop)))
        # the same images as datasets: a key differs where the dataset's crop is not --crop, and only there
        differs = [a != b for a, b in zip(expected, _all_keys(several, _config(crop))[0], strict=True)]
        assert differs == [row["dataset"] == STYLE and crop != CropMode.RANDOM for row in _rows(several)]
    assert ScanRows(str(scan)).crop is None
    assert {job.crop for job in read_jobs(str(scan), _recipe("center"), {}).rows()} == {None}


def test_a_made_up_recipe_naming_no_crop_keys_every_row_alike(tmp_path: Path) -> None:
    """stk-train's seeds for crops on the fly: the same recipe whatever a row's crop."""
    scan = write_scan(tmp_path)
    seeds = read_jobs(str(scan), {"seed": 0}, {}).rows()
    assert [job.key for job in seeds] == [latent_key(row, {"seed": 0}) for row in _rows(scan)]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda doc: doc["datasets"].pop(), rf"{METADATA} is damaged \(its dataset photos is not in {BUCKETS}\)"),
        (lambda doc: doc["datasets"][0].update(crop="diagonal"), rf"{BUCKETS} is damaged \(a dataset's crop: "),
        (lambda doc: doc.pop("datasets"), rf"{BUCKETS} is damaged \(no \"datasets\" list"),
    ],
)
def test_a_dataset_column_buckets_json_does_not_explain_is_damage(tmp_path: Path, change: Any, named: str) -> None:
    scan = write_scan(tmp_path, images=1)
    document = json.loads((scan / BUCKETS).read_text())
    change(document)
    (scan / BUCKETS).write_text(json.dumps(document))
    for read in (lambda: ScanRows(str(scan)), lambda: read_jobs(str(scan), _recipe("center"), {})):
        with pytest.raises(CacheIncomplete, match=named) as raised:
            read()
        assert raised.value.exit_code == 6 and "rerun `stk-scan" in str(raised.value)
