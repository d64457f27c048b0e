"""kohya sd-scripts' dataset TOML converted to stk datasets: settings inherited from [general] and
[[datasets]] down to each subset, a warning line where a setting stk has no use for is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.dataset_files import refusal

from stk.buckets import ResolutionType
from stk.captions import MissingCaption
from stk.datasets import DatasetSpec, read_datasets
from stk.images.preprocess import CropMode

# The first example of sd-scripts' docs/config_README-en.md, as written there (Windows paths and all).
DOCUMENTED = r"""
[general]
shuffle_caption = true
caption_extension = '.txt'
keep_tokens = 1

# This is a DreamBooth-style dataset
[[datasets]]
resolution = 512
batch_size = 4
keep_tokens = 2

  [[datasets.subsets]]
  image_dir = 'C:\hoge'
  class_tokens = 'hoge girl'
  # This subset uses keep_tokens = 2 (the value of the parent datasets)

  [[datasets.subsets]]
  image_dir = 'C:\fuga'
  class_tokens = 'fuga boy'
  keep_tokens = 3

  [[datasets.subsets]]
  is_reg = true
  image_dir = 'C:\reg'
  class_tokens = 'human'
  keep_tokens = 1

# This is a fine-tuning dataset
[[datasets]]
resolution = [768, 768]
batch_size = 2

  [[datasets.subsets]]
  image_dir = 'C:\piyo'
  metadata_file = 'C:\piyo\piyo_md.json'
  # This subset uses keep_tokens = 1 (the value of [general])
"""

# The same docs' example of secondary_separator, wildcards and keep_tokens_separator (two long comments
# kept in English only), and (the last two [[datasets]]) its example of one image_dir in two datasets at two
# resolutions, with enable_bucket added.
SEPARATORS = """
[general]
flip_aug = true
color_aug = false
resolution = [1024, 1024]

[[datasets]]
batch_size = 6
enable_bucket = true
bucket_no_upscale = true
caption_extension = ".txt"
keep_tokens_separator= "|||"
shuffle_caption = true
caption_tag_dropout_rate = 0.1
secondary_separator = ";;;" # subset 側に書くこともできます / can be written in the subset side
enable_wildcard = true # 同上 / same as above

  [[datasets.subsets]]
  image_dir = "/path/to/image_dir"
  num_repeats = 1

  # No comma is required before and after ||| (it is added automatically)
  caption_prefix = "1girl, hatsune miku, vocaloid |||"

  # ||| の後はシャッフル、drop されず残ります / After |||, it is not shuffled or dropped and remains
  # It is simply concatenated as a string, so you need to put commas yourself
  caption_suffix = ", anime screencap ||| masterpiece, rating: general"

[[datasets]]
resolution = 512
enable_bucket = true

  [[datasets.subsets]]
  image_dir = '/data/hoge'

[[datasets]]
resolution = 768
enable_bucket = true

  [[datasets.subsets]]
  image_dir = '/data/hoge'
"""

NO_BUCKETS = (
    "enable_bucket is not true (kohya's default): kohya crops every image to the resolution's width x height; "
    "stk sorts images into aspect buckets of that area"
)
CLASS_TOKENS = (
    "class_tokens is not supported by stk: an image with no caption file fails the scan (kohya captions it with "
    "them), so write them into its caption file; ignored"
)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "dataset_config.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_documented_example_converts_subset_by_subset(tmp_path: Path) -> None:
    path = write(tmp_path, DOCUMENTED)
    found = read_datasets(path)
    assert found.format == "kohya"
    # the .txt of [general]; an image without one fails, where kohya would caption it with the class_tokens
    dreambooth = {
        "resolution": 512 * 512 / 1e6,
        "resolution_type": ResolutionType.AREA,
        "caption_extension": ".txt",
        "missing_caption": MissingCaption.ERROR,
    }
    assert found.specs == [
        DatasetSpec(name="hoge", source="C:\\hoge", **dreambooth, repeats=1),
        DatasetSpec(name="fuga", source="C:\\fuga", **dreambooth, repeats=1),
        DatasetSpec(
            name="piyo", source="C:\\piyo", resolution=768 * 768 / 1e6, resolution_type=ResolutionType.AREA, repeats=1
        ),
    ]
    first, second = f"{path}, [[datasets]] 1", f"{path}, [[datasets]] 2"
    assert found.warnings == [
        f"{path}, [general]: shuffle_caption is not supported by stk; ignored",
        f"{path}, [general]: keep_tokens is not supported by stk; ignored",
        f"{first}: batch_size belongs to stk-scan's and stk-train's --batch-size; ignored",
        f"{first}: keep_tokens is not supported by stk; ignored",
        f"{first}: {NO_BUCKETS}",
        f"{path}, dataset 'hoge': {CLASS_TOKENS}",
        f"{path}, dataset 'fuga': keep_tokens is not supported by stk; ignored",
        f"{path}, dataset 'fuga': {CLASS_TOKENS}",
        f"{first}, subset 3 (C:\\reg): is_reg: regularisation images are not supported by stk; skipped",
        f"{second}: batch_size belongs to stk-scan's and stk-train's --batch-size; ignored",
        f"{second}: {NO_BUCKETS}",
        f"{path}, dataset 'piyo': metadata_file is not read by stk: captions come from .txt/.caption files beside "
        "the images or a .jsonl table (stk-scan TABLE); ignored",
    ]


def test_settings_inherit_down_and_one_directory_in_two_datasets_gets_two_names(tmp_path: Path) -> None:
    path = write(tmp_path, SEPARATORS)
    found = read_datasets(path)
    area = ResolutionType.AREA
    # no class_tokens: kohya captions an image without a caption file with ""; the .txt of the first [[datasets]],
    # kohya's default .caption for the others
    captions = {"missing_caption": MissingCaption.EMPTY}
    assert found.specs == [
        DatasetSpec(
            "image_dir", "/path/to/image_dir", 1, None, 1024 * 1024 / 1e6, area, **captions, caption_extension=".txt"
        ),
        DatasetSpec(
            "hoge",
            "/data/hoge",
            1,
            resolution=512 * 512 / 1e6,
            resolution_type=area,
            **captions,
            caption_extension=".caption",
        ),
        DatasetSpec(
            "hoge-2",
            "/data/hoge",
            1,
            resolution=768 * 768 / 1e6,
            resolution_type=area,
            **captions,
            caption_extension=".caption",
        ),
    ]
    first = f"{path}, [[datasets]] 1"
    assert found.warnings == [
        f"{path}, [general]: flip_aug is not supported by stk; ignored",
        f"{path}, [general]: color_aug is not supported by stk; ignored",
        f"{first}: batch_size belongs to stk-scan's and stk-train's --batch-size; ignored",
        f"{first}: bucket_no_upscale is not supported by stk; ignored",
        f"{first}: keep_tokens_separator is not supported by stk; ignored",
        f"{first}: shuffle_caption is not supported by stk; ignored",
        f"{first}: caption_tag_dropout_rate is not supported by stk; ignored",
        f"{first}: secondary_separator is not supported by stk; ignored",
        f"{first}: enable_wildcard is not supported by stk; ignored",
        f"{path}, dataset 'image_dir': caption_prefix is not supported by stk; ignored",
        f"{path}, dataset 'image_dir': caption_suffix is not supported by stk; ignored",
    ]


def test_repeats_crop_dropout_and_caption_files(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[general]
enable_bucket = true
random_crop = true
caption_dropout_rate = 0.05

[[datasets]]
num_repeats = 10
caption_extension = ".md"

  [[datasets.subsets]]
  image_dir = "/data/style"

  [[datasets.subsets]]
  image_dir = "/data/photos"
  num_repeats = 1
  random_crop = false
  caption_extension = "caption"

  [[datasets.subsets]]
  image_dir = "/data/photos"
""",
    )
    found = read_datasets(path)
    assert [(s.name, s.repeats, s.crop, s.caption_dropout, s.caption_extension) for s in found.specs] == [
        ("style", 10, CropMode.RANDOM, 0.05, ".md"),  # any extension kohya reads
        ("photos", 1, CropMode.CENTER, 0.05, ".caption"),  # the '.' kohya adds
    ]
    assert found.warnings == [
        f"{path}, [[datasets]] 1, subset 3 (/data/photos): the same image_dir twice in one dataset, which kohya "
        "ignores; skipped",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("general = 1\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = '/d'\n", "[general] must be a table"),
        ("[datasets]\nresolution = 512\n", "datasets must be an array of tables"),
        ("[[datasets]]\nresolution = 512\n", "[[datasets]] 1: no subsets"),
        ("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 2\n", "[[datasets]] 1, subset 1: no image_dir"),
        ("[[datasets]]\nresolution = 'big'\n[[datasets.subsets]]\nimage_dir = '/d'\n", "resolution = 'big' is not"),
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = '/d'\nnum_repeats = 0\n", "repeats must be at least 1"),
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = '/d'\nis_reg = true\n", "no datasets"),
    ],
)
def test_bad_configs_are_refused_in_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    assert message in refusal(path)
