"""SimpleTuner's multidatabackend.json converted to stk datasets, with a warning line for what is left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.dataset_files import refusal

from stk.buckets import Aspect, ResolutionType
from stk.captions import CaptionSource, MissingCaption
from stk.datasets import DatasetSpec, read_datasets
from stk.images.preprocess import CropMode

# Copied from SimpleTuner's documentation/DATALOADER.md: the first two entries are its "most basic example",
# "photo-concept-bucket" is its "Parquet caption strategy" example, and the last three its "Local cache with
# cloud dataset" example.
DOCUMENTED = """
[
  {
    "id": "something-special-to-remember-by",
    "type": "local",
    "instance_data_dir": "/path/to/data/tree",
    "crop": true,
    "crop_style": "center",
    "crop_aspect": "square",
    "resolution": 1024,
    "minimum_image_size": 768,
    "maximum_image_size": 2048,
    "minimum_aspect_ratio": 0.50,
    "maximum_aspect_ratio": 3.00,
    "target_downsample_size": 1024,
    "resolution_type": "pixel_area",
    "prepend_instance_prompt": false,
    "instance_prompt": "something to label every image",
    "only_instance_prompt": false,
    "caption_strategy": "textfile",
    "cache_dir_vae": "/path/to/vaecache",
    "repeats": 0
  },
  {
    "id": "an example backend for text embeds.",
    "dataset_type": "text_embeds",
    "default": true,
    "type": "aws",
    "aws_bucket_name": "textembeds-something-yummy",
    "aws_region_name": null,
    "aws_endpoint_url": "https://foo.bar/",
    "aws_access_key_id": "wpz-764e9734523434",
    "aws_secret_access_key": "xyz-sdajkhfhakhfjd",
    "aws_data_prefix": "",
    "cache_dir": ""
  },
  {
    "id": "photo-concept-bucket",
    "type": "local",
    "instance_data_dir": "/models/training/datasets/photo-concept-bucket-downloads",
    "caption_strategy": "parquet",
    "metadata_backend": "parquet",
    "parquet": {
      "path": "photo-concept-bucket.parquet",
      "filename_column": "id",
      "caption_column": "cogvlm_caption",
      "fallback_caption_column": "tags",
      "width_column": "width",
      "height_column": "height",
      "identifier_includes_extension": false
    },
    "resolution": 1.0,
    "minimum_image_size": 0.75,
    "maximum_image_size": 2.0,
    "target_downsample_size": 1.5,
    "prepend_instance_prompt": false,
    "instance_prompt": null,
    "only_instance_prompt": false,
    "disable": false,
    "cache_dir_vae": "/models/training/vae_cache/photo-concept-bucket",
    "probability": 1.0,
    "skip_file_discovery": "",
    "preserve_data_backend_cache": false,
    "vae_cache_clear_each_epoch": true,
    "repeats": 1,
    "crop": true,
    "crop_aspect": "closest",
    "crop_style": "random",
    "crop_aspect_buckets": [1.0, 0.75, 1.23],
    "resolution_type": "area"
  },
  {
    "id": "data",
    "type": "aws",
    "aws_bucket_name": "text-vae-embeds",
    "aws_endpoint_url": "https://storage.provider.example",
    "aws_access_key_id": "exampleAccessKey",
    "aws_secret_access_key": "exampleSecretKey",
    "aws_region_name": null,
    "cache_dir_vae": "/local/path/to/cache/vae/",
    "caption_strategy": "parquet",
    "metadata_backend": "parquet",
    "parquet": {
      "path": "train.parquet",
      "caption_column": "caption",
      "filename_column": "filename",
      "width_column": "width",
      "height_column": "height",
      "identifier_includes_extension": true
    },
    "preserve_data_backend_cache": false,
    "image_embeds": "vae-embed-storage"
  },
  {
    "id": "vae-embed-storage",
    "type": "local",
    "dataset_type": "image_embeds"
  },
  {
    "id": "text-embed-storage",
    "type": "local",
    "dataset_type": "text_embeds",
    "default": true,
    "cache_dir": "/local/path/to/cache/textencoder/",
    "write_batch_size": 128
  }
]
"""


def write(tmp_path: Path, entries: Any) -> str:
    path = tmp_path / "multidatabackend.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries), encoding="utf-8")
    return str(path)


def image(**settings: Any) -> dict[str, Any]:
    return {"id": "photos", "type": "local", "instance_data_dir": "/data/photos", **settings}


def test_the_documented_examples_convert_with_a_warning_line_for_each_setting_left_out(tmp_path: Path) -> None:
    path = write(tmp_path, DOCUMENTED)
    found = read_datasets(path)
    assert found.format == "simpletuner"
    assert found.specs == [
        DatasetSpec(
            name="something-special-to-remember-by",
            source="/path/to/data/tree",
            repeats=1,  # SimpleTuner's repeats 0: seen once
            resolution=1024 * 1024 / 1e6,  # pixel_area 1024: the area of 1024x1024, in megapixels
            resolution_type=ResolutionType.AREA,
            min_aspect=0.5,
            max_aspect=3.0,
            missing_caption=MissingCaption.ERROR,  # textfile: the .txt beside each image, and no other
            caption_extension=".txt",
            crop=CropMode.CENTER,
            aspect=Aspect.SQUARE,  # crop_aspect square
        ),
        DatasetSpec(
            name="photo-concept-bucket",
            source="photo-concept-bucket.parquet",
            root="/models/training/datasets/photo-concept-bucket-downloads",
            caption_column="cogvlm_caption",
            repeats=2,  # SimpleTuner's repeats 1: seen twice
            weight=1.0,
            resolution=1.0,
            resolution_type=ResolutionType.AREA,
            crop=CropMode.RANDOM,
        ),
        DatasetSpec(
            name="data",
            source="s3://text-vae-embeds/train.parquet",  # read through the dataset's own bucket
            root="s3://text-vae-embeds",
            caption_column="caption",
            repeats=1,
        ),
    ]
    names = ("something-special-to-remember-by", "photo-concept-bucket", "data")
    first, concept, data = (f"{path}, dataset {name!r}" for name in names)
    assert found.warnings == [
        f"{first}: minimum_image_size is an area here; stk's min-size is the short edge in pixels; ignored",
        f"{first}: maximum_image_size is not supported by stk; ignored",
        f"{first}: target_downsample_size is not supported by stk; ignored",
        f"{first}: prepend_instance_prompt is not supported by stk; ignored",
        f"{first}: instance_prompt is not supported by stk; ignored",
        f"{first}: only_instance_prompt is not supported by stk; ignored",
        f"{first}: cache_dir_vae is not carried: stk-cache --out holds the cache; ignored",
        f"{path}, dataset 'an example backend for text embeds.': dataset_type text_embeds is a cache backend "
        "(stk-cache writes its own cache); skipped",
        f"{concept}: parquet.filename_column 'id': stk reads the path column as one of path, filename, file_name, "
        "file, image, image_path",
        f"{concept}: parquet.identifier_includes_extension is not true: stk needs file names with their extension",
        f"{concept}: parquet.fallback_caption_column is not supported by stk; ignored",
        f"{concept}: minimum_image_size is an area here; stk's min-size is the short edge in pixels; ignored",
        f"{concept}: crop_aspect closest: stk crops each image to the nearest of its own aspect buckets "
        "(not crop_aspect_buckets)",
        f"{concept}: maximum_image_size is not supported by stk; ignored",
        f"{concept}: target_downsample_size is not supported by stk; ignored",
        f"{concept}: prepend_instance_prompt is not supported by stk; ignored",
        f"{concept}: only_instance_prompt is not supported by stk; ignored",
        f"{concept}: cache_dir_vae is not carried: stk-cache --out holds the cache; ignored",
        f"{concept}: preserve_data_backend_cache is not supported by stk; ignored",
        f"{concept}: vae_cache_clear_each_epoch is not supported by stk; ignored",
        f"{data}: aws_endpoint_url is not carried: give stk-scan --s3-endpoint-url (or [s3] endpoint_url in --config)",
        f"{data}: aws_access_key_id is not carried: boto3 reads S3 credentials from its usual chain "
        "(AWS_ACCESS_KEY_ID, AWS_PROFILE)",
        f"{data}: aws_secret_access_key is not carried: boto3 reads S3 credentials from its usual chain "
        "(AWS_ACCESS_KEY_ID, AWS_PROFILE)",
        f"{data}: cache_dir_vae is not carried: stk-cache --out holds the cache; ignored",
        f"{data}: preserve_data_backend_cache is not supported by stk; ignored",
        f"{data}: image_embeds is not carried: stk-cache --out holds the latents; ignored",
        f"{path}, dataset 'vae-embed-storage': dataset_type image_embeds is a cache backend "
        "(stk-cache writes its own cache); skipped",
        f"{path}, dataset 'text-embed-storage': dataset_type text_embeds is a cache backend "
        "(stk-cache writes its own cache); skipped",
    ]
    assert not any("exampleSecretKey" in line for line in found.warnings)  # keys are named, never their values


def test_repeats_count_the_extra_passes_there_and_every_pass_here(tmp_path: Path) -> None:
    entries = [image(id="once", repeats=0), image(id="ten-times", repeats=9), image(id="unset")]
    assert [spec.repeats for spec in read_datasets(write(tmp_path, entries)).specs] == [1, 10, 1]


def test_pixel_resolution_keeps_its_short_edge_and_minimum_size(tmp_path: Path) -> None:
    found = read_datasets(write(tmp_path, [image(resolution=768, resolution_type="pixel", minimum_image_size=511.5)]))
    spec = found.specs[0]
    assert (spec.resolution, spec.resolution_type, spec.min_size) == (768.0, ResolutionType.PIXEL, 512)
    assert found.warnings == []


def test_captions_crop_dropout_and_an_s3_dataset(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            image(id="by-name", caption_strategy="filename", crop=True, caption_dropout_probability=0.1),
            {
                "id": "bucket",
                "type": "aws",
                "aws_bucket_name": "images",
                "aws_data_prefix": "/sets/style/",
                "aws_endpoint_url": "http://minio:9000",
                "caption_strategy": "textfile",
            },
        ],
    )
    by_name, bucket = read_datasets(path).specs
    assert (by_name.captions, by_name.missing_caption, by_name.caption_extension) == (CaptionSource.STEM, None, None)
    assert by_name.crop is CropMode.RANDOM  # crop true without crop_style: SimpleTuner's default style
    assert by_name.aspect is Aspect.SQUARE  # and without crop_aspect: its default, square
    assert by_name.caption_dropout == 0.1
    assert (bucket.source, bucket.missing_caption) == ("s3://images/sets/style", MissingCaption.ERROR)
    assert (bucket.caption_extension, bucket.captions, bucket.aspect) == (".txt", None, None)
    assert read_datasets(path).warnings == [
        f"{path}, dataset 'bucket': aws_endpoint_url is not carried: give stk-scan --s3-endpoint-url "
        "(or [s3] endpoint_url in --config)"
    ]


def test_what_stk_cannot_do_is_one_warning_line_each(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            image(id="my photos", crop=True, crop_style="corner", caption_strategy="instanceprompt"),
            image(id="loose", crop=False, crop_style="center", resolution=1024),
            image(id="off", disabled=True),
            image(id="clips", dataset_type="video"),
            {"id": "urls", "type": "csv", "csv_file": "list.csv"},
            image(id="masks", dataset_type="conditioning", conditioning_type="mask"),
        ],
    )
    found = read_datasets(path)
    assert [spec.name for spec in found.specs] == ["my-photos", "loose"]
    assert (found.specs[0].crop, found.specs[1].crop, found.specs[1].resolution) == (None, None, 1024.0)
    photos, loose = f"{path}, dataset 'my photos'", f"{path}, dataset 'loose'"
    assert found.warnings == [
        f"{photos}: id 'my photos' is named 'my-photos' in stk (letters, digits, '.', '_', '-')",
        f"{photos}: caption_strategy instanceprompt is not supported by stk (textfile, filename, parquet): captions "
        "from .txt/.caption files, else stk-scan's --missing-caption",
        f"{photos}: crop_style corner is not supported by stk (center, random); left to stk-cache's --crop",
        f"{loose}: resolution has no resolution_type: stk-scan's --resolution-type applies to it",
        f"{loose}: crop is not true: stk crops every image to its bucket; left to stk-cache's --crop",
        f"{loose}: crop_style applies only with crop true; ignored",
        f"{path}, dataset 'off': disabled; skipped",
        f"{path}, dataset 'clips': dataset_type video is not supported by stk (images only); skipped",
        f"{path}, dataset 'urls': type csv is not supported by stk (a local directory or an aws bucket); skipped",
        f"{path}, dataset 'masks': dataset_type conditioning is not supported by stk (images only); skipped",
    ]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([["not", "an", "object"]], "entry 1: not a JSON object"),
        ([{"type": "local", "instance_data_dir": "/d"}], "entry 1: no id"),
        ([{"id": "photos", "type": "local"}], "dataset 'photos': no instance_data_dir"),
        ([{"id": "photos", "type": "aws"}], "dataset 'photos': type aws needs aws_bucket_name"),
        ([image(caption_strategy="parquet")], "caption_strategy parquet needs a parquet block with a path"),
        ([image(resolution_type="megapixel")], "resolution_type = 'megapixel', expected one of pixel, area"),
        ([image(resolution="1024")], "resolution = '1024' is not a number"),
        ([image(repeats=1.5)], "repeats = 1.5 is not an integer"),
        ([image(probability=0)], "dataset 'photos' (photos): weight must be above 0, not 0"),
        ([image(), image()], "two datasets are named 'photos'"),
        ([image(disabled=True)], "no datasets"),
        ([], "no datasets"),
    ],
)
def test_bad_lists_are_refused_in_one_line_naming_the_file(tmp_path: Path, entries: Any, message: str) -> None:
    path = write(tmp_path, entries)
    assert message in refusal(path)
