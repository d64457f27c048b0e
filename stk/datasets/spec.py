"""One dataset of a run and its own settings: what a `[[dataset]]` table of stk's TOML holds.

A field left out (None) takes the command's option of the same name (`--resolution`, `--crop`, ...), so
a list that only names its sources behaves like one stk-scan per source with the same options.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stk.buckets import Aspect, ResolutionType
from stk.captions import CaptionSource, MissingCaption
from stk.errors import InputError
from stk.images.info import is_image_name
from stk.images.preprocess import CropMode

__all__ = ["FIELDS", "DatasetSpec", "check_datasets", "dataset_from_table"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a directory name on every file system and S3
_EXTENSION = re.compile(r"^\.[^/\\\s]+$")  # ".caption", ".cap.txt": no separator, no space


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # unique in the run; names its subdirectory of the scan and its rows' `dataset`
    source: str  # anything stk-scan takes: a directory, s3://bucket/prefix, a .parquet/.jsonl table
    repeats: int | None = None  # times each image is seen per epoch
    weight: float | None = None  # the probability of drawing from it; None everywhere: an epoch by repeats
    resolution: float | None = None
    resolution_type: ResolutionType | None = None
    min_aspect: float | None = None
    max_aspect: float | None = None
    min_size: int | None = None
    missing_caption: MissingCaption | None = None
    caption_column: str | None = None  # a table source's caption column (stk-scan --column caption=X)
    root: str | None = None  # what a table source's relative paths are under (stk-scan --root)
    caption_dropout: float | None = None  # the share of its samples trained with the empty caption
    crop: CropMode | None = None  # where stk-cache crops its images to their bucket
    aspect: Aspect | None = None  # square: one square bucket, every image cropped to it
    captions: CaptionSource | None = None  # stem: every caption from its file name (SimpleTuner's filename)
    caption_extension: str | None = None  # the one sidecar read (kohya's caption_extension); else .txt, .caption

    def toml_table(self) -> dict[str, Any]:
        """The fields given, as stk's TOML writes them (kebab-case keys, enums as their values)."""
        table: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                table[field.name.replace("_", "-")] = getattr(value, "value", value)
        return table


FIELDS = {field.name.replace("_", "-"): field.name for field in fields(DatasetSpec)}
_ENUMS: dict[str, type[Any]] = {
    "resolution_type": ResolutionType,
    "missing_caption": MissingCaption,
    "crop": CropMode,
    "aspect": Aspect,
    "captions": CaptionSource,
}
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "source": (str,),
    "caption_column": (str,),
    "root": (str,),
    "caption_extension": (str,),
    "repeats": (int,),
    "min_size": (int,),
    "weight": (int, float),
    "resolution": (int, float),
    "min_aspect": (int, float),
    "max_aspect": (int, float),
    "caption_dropout": (int, float),
}
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number"}


def dataset_from_table(table: Mapping[str, Any], where: str) -> DatasetSpec:
    """A `[[dataset]]` table checked field by field; `where` names it in an error ("datasets.toml, dataset 2")."""
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = FIELDS[key]
        if name in _ENUMS:
            choices = [member.value for member in _ENUMS[name]]
            if value not in choices:
                raise InputError(f"{where}: {key} = {value!r}, expected one of {', '.join(choices)}")
            values[name] = _ENUMS[name](value)
        elif isinstance(value, bool) or not isinstance(value, _TYPES[name]):
            raise InputError(f"{where}: {key} = {value!r} is not {_TYPE_NAMES[_TYPES[name][-1]]}")
        elif isinstance(value, float) and not math.isfinite(value):  # TOML's nan and inf, JSON's NaN and Infinity
            raise InputError(f"{where}: {key} = {value} is not a finite number")
        else:
            values[name] = float(value) if isinstance(value, int) and float in _TYPES[name] else value
    for required in ("name", "source"):
        if required not in values:
            raise InputError(f"{where}: no {required}")
    spec = DatasetSpec(**values)
    _check_values(spec, where)
    return spec


def _check_values(spec: DatasetSpec, where: str) -> None:
    if not _NAME.match(spec.name):
        raise InputError(f"{where}: name {spec.name!r} must be letters, digits, '.', '_' or '-'")
    if spec.repeats is not None and spec.repeats < 1:
        raise InputError(f"{where} ({spec.name}): repeats must be at least 1, not {spec.repeats}")
    if spec.weight is not None and spec.weight <= 0:
        raise InputError(f"{where} ({spec.name}): weight must be above 0, not {spec.weight:g}")
    if spec.caption_dropout is not None and not 0 <= spec.caption_dropout <= 1:
        raise InputError(f"{where} ({spec.name}): caption-dropout must be in [0, 1], not {spec.caption_dropout:g}")
    if spec.resolution is not None and spec.resolution <= 0:
        raise InputError(f"{where} ({spec.name}): resolution must be above 0, not {spec.resolution:g}")
    if spec.min_size is not None and spec.min_size < 0:
        raise InputError(f"{where} ({spec.name}): min-size must be 0 or more, not {spec.min_size}")
    _check_captions(spec, f"{where} ({spec.name})")


def _check_captions(spec: DatasetSpec, where: str) -> None:
    extension = spec.caption_extension
    if extension is not None and not _EXTENSION.match(extension):
        raise InputError(f"{where}: caption-extension {extension!r} must be '.' and a name, as '.caption'")
    if extension is not None and is_image_name("x" + extension):
        raise InputError(f"{where}: caption-extension {extension!r} is an image's; captions are text files")
    if spec.captions is CaptionSource.STEM and (extension is not None or spec.missing_caption is not None):
        given = "caption-extension" if extension is not None else "missing-caption"
        raise InputError(f'{where}: {given} does not apply with captions = "stem" (every caption is its file\'s stem)')


def check_datasets(specs: Sequence[DatasetSpec], where: str) -> None:
    """What only the whole list can say: it is not empty and no name is used twice."""
    if not specs:
        raise InputError(f"{where}: no datasets")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InputError(f"{where}: two datasets are named {spec.name!r}; each name must be unique")
        seen.add(spec.name)
