"""datasets_toml: the stk TOML of a list, which read_datasets reads back to the same specs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from stk.buckets import Aspect, ResolutionType
from stk.captions import CaptionSource, MissingCaption
from stk.datasets import DatasetSpec, datasets_toml, read_datasets
from stk.errors import InputError
from stk.images.preprocess import CropMode

SPECS = [
    DatasetSpec(
        name="style.v2",
        source='C:\\data\\"quoted"\tand\nodd \x01\x7f é 名前',
        repeats=10,
        weight=0.1,
        resolution=1024 * 1024 / 1e6,
        resolution_type=ResolutionType.AREA,
        min_aspect=0.5,
        max_aspect=2.0,
        min_size=512,
        missing_caption=MissingCaption.FILENAME,
        caption_column="text",
        root="s3://bucket/images",
        caption_dropout=1e-05,
        crop=CropMode.RANDOM,
        aspect=Aspect.SQUARE,
        caption_extension=".caption",
    ),
    DatasetSpec(name="photos", source="/data/photos", weight=1e16, captions=CaptionSource.STEM),
    DatasetSpec(name="plain", source="/data/plain"),
]


def test_a_list_written_reads_back_to_the_same_specs(tmp_path: Path) -> None:
    text = datasets_toml(SPECS)
    path = tmp_path / "datasets.toml"
    path.write_text(text, encoding="utf-8")
    found = read_datasets(str(path))
    assert (found.format, found.specs, found.warnings) == ("stk", SPECS, [])
    assert text.startswith('[[dataset]]\nname = "style.v2"\nsource = "C:\\\\data\\\\\\"quoted\\"\\tand\\nodd \\u0001')
    assert text.endswith('\n\n[[dataset]]\nname = "plain"\nsource = "/data/plain"\n')  # the rest: the options


def test_infinite_weight_is_valid_toml_that_the_reader_refuses_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "inf.toml"
    path.write_text(datasets_toml([DatasetSpec(name="a", source="/a", weight=math.inf)]), encoding="utf-8")
    with pytest.raises(InputError, match=r"inf\.toml, dataset 1: weight = inf is not a finite number$"):
        read_datasets(str(path))  # read as TOML (its float inf), then refused as a weight
