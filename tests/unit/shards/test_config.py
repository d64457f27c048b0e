"""stk.shards.config: a recorded cache config reads back to the same JSON and keys; one stk-cache did not make is
refused in one line."""

from __future__ import annotations

import json

import pytest

from stk.errors import InputError
from stk.images.preprocess import CropMode
from stk.shards import (
    Manifest,
)
from stk.shards.config import CacheConfig, EncodeSettings
from stk.shards.keys import latent_key, text_key

# a cache config as stk-cache has always written it (trimmed encoders): what every older cache holds
RECORDED_CONFIG = """{
 "family": "flux",
 "model": {"family": "flux", "model": "/models/flux",
  "vae": {"class": "AutoencoderKL", "scaling_factor": 0.3611, "shift_factor": 0.1159, "dtype": "bfloat16"},
  "text": {"outputs": ["prompt_embeds"], "dtype": "bfloat16", "encoders": []}},
 "latents": {"crop": "center", "store_logvar": false, "dtype": "float16"},
 "text": {"trim_padding": true, "dtype": "float16"},
 "buckets": {"resolution": 1024, "resolution_type": "side", "alignment": 16},
 "scaling_factor": 0.3611,
 "shift_factor": 0.1159
}"""


def test_a_recorded_cache_config_reads_back_to_the_same_json_and_the_same_keys() -> None:
    recorded = json.loads(RECORDED_CONFIG)
    config = CacheConfig.from_json(recorded, "cache/manifest.json")
    assert config.settings == EncodeSettings(CropMode.CENTER, store_logvar=False, dtype="float16", trim_padding=True)
    assert (config.family, config.norm.scaling_factor, config.norm.shift_factor) == ("flux", 0.3611, 0.1159)
    assert json.dumps(config.to_json(), indent=1) == json.dumps(recorded, indent=1)  # key order included
    assert Manifest.new(config).header() == {
        "version": 1,
        "config": recorded,
        "scaling_factor": 0.3611,
        "validation_prompts": [],
    }
    # the keys the recipes give, pinned: a change here would orphan every cache made so far
    row = {"path": "a/b.jpg", "bytes": 1000, "mtime": 1.5, "bucket_width": 64, "bucket_height": 48}
    assert latent_key(row, config.latent_recipe()) == "66282d140925c1f94a1e0923c1285fbaa50d0f50"
    assert text_key("a cat", config.text_recipe()) == "038dc3d08f823dc62787e50fa1bce457e71a604f"
    assert config.differences({**recorded, "model": {**recorded["model"], "model": "/elsewhere"}}) == []
    assert config.differences({**recorded, "latents": {"crop": "random"}, "shift_factor": None}) == [
        "latents",
        "shift_factor",
    ]


@pytest.mark.parametrize("broken", ["family", "latents", "buckets", "scaling_factor", "model"])
def test_a_config_stk_cache_did_not_make_is_one_input_error_naming_the_manifest(broken: str) -> None:
    recorded = json.loads(RECORDED_CONFIG)
    if broken == "model":
        recorded["model"] = "tiny"
    else:
        del recorded[broken]
    with pytest.raises(InputError, match=r"^cache/manifest\.json: no usable .* \(not made by stk-cache\)$"):
        CacheConfig.from_json(recorded, "cache/manifest.json")


def test_a_cache_records_the_resolutions_and_crops_of_a_scan_of_several_datasets() -> None:
    one = {"resolution": 1024, "resolution_type": "side", "alignment": 16, "buckets": [], "repeats": 1}
    assert CacheConfig.scan_buckets(one) == json.loads(RECORDED_CONFIG)["buckets"]  # as every cache recorded it

    def dataset(name: str, resolution: int, crop: str | None) -> dict[str, object]:
        return {"name": name, "resolution": resolution, "resolution_type": "side", "crop": crop, "repeats": 10}

    several = {**one, "datasets": [dataset("style", 512, "random"), dataset("photos", 1024, None)]}
    recorded = CacheConfig.scan_buckets(several)
    assert recorded == {
        **CacheConfig.scan_buckets(one),
        "datasets": [
            {"crop": "random", "resolution": 512, "resolution_type": "side"},
            {"crop": None, "resolution": 1024, "resolution_type": "side"},
        ],
    }
    config = CacheConfig.from_json({**json.loads(RECORDED_CONFIG), "buckets": recorded}, "cache/manifest.json")
    # a dataset added or renamed with settings the cache has is none; a resolution or crop it has not is one
    added = {**several, "datasets": [*several["datasets"], dataset("more", 512, "random")]}
    assert config.differences({**config.to_json(), "buckets": CacheConfig.scan_buckets(added)}) == []
    for changed in (dataset("style", 768, "random"), dataset("style", 512, "center")):
        other = {**several, "datasets": [changed, several["datasets"][1]]}
        assert config.differences({**config.to_json(), "buckets": CacheConfig.scan_buckets(other)}) == ["buckets"]


def test_a_latent_recipe_under_a_datasets_crop_differs_in_its_crop_alone() -> None:
    config = CacheConfig.from_json(json.loads(RECORDED_CONFIG), "cache/manifest.json")
    recipe = config.latent_recipe()
    assert CacheConfig.with_crop(recipe, CropMode.CENTER) == recipe  # --crop's own: the keys every cache has
    random = CacheConfig.with_crop(recipe, CropMode.RANDOM)
    assert (
        random == {**recipe, "latents": {**recipe["latents"], "crop": "random"}}
        and recipe["latents"]["crop"] == "center"
    )
    assert CacheConfig.with_crop({"seed": 0}, CropMode.RANDOM) == {"seed": 0}
