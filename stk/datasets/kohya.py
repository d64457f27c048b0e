"""kohya sd-scripts' dataset TOML (`--dataset_config`) as stk datasets.

What each key means is taken from sd-scripts' docs/config_README-en.md: `[general]` holds defaults for
every dataset and subset, each `[[datasets]]` its own (resolution, batch size, buckets), each
`[[datasets.subsets]]` one image directory; a setting given lower wins. Each subset becomes one stk
dataset named after its directory, its captions read as kohya reads them (library/train_util.py): the file
of the image's stem with `caption_extension`, an image without one captioned "". A key stk has no use for
becomes one warning line where it is written.
"""

from __future__ import annotations

import re
from typing import Any

from stk.datasets.convert import Fields, dataset_name, number, unique_name
from stk.datasets.spec import DatasetSpec, dataset_from_table
from stk.errors import InputError

__all__ = ["convert"]

# The settings stk carries over, from any level; a lower level's value wins.
_INHERITED = (
    "resolution",
    "enable_bucket",
    "num_repeats",
    "random_crop",
    "caption_extension",
    "caption_dropout_rate",
    "class_tokens",
)
_CAPTION_EXTENSION = ".caption"  # kohya's default (library/config_util.py), '.' added where it is left out
_CLASS_TOKENS = (
    "is not supported by stk: an image with no caption file fails the scan (kohya captions it with them), so write "
    "them into its caption file; ignored"
)
_REASONS = {
    "batch_size": "belongs to stk-scan's and stk-train's --batch-size; ignored",
    "bucket_reso_steps": "is not carried: stk-scan --family sets the multiple of the bucket sides; ignored",
    "metadata_file": "is not read by stk: captions come from .txt/.caption files beside the images or a .jsonl "
    "table (stk-scan TABLE); ignored",
}


def convert(document: dict[str, Any], path: str) -> tuple[list[DatasetSpec], list[str]]:
    """One stk dataset per subset, in the file's order, and the warnings about what was left out."""
    warnings = [f"{path}: [{key}] is not supported by stk; ignored" for key in document if key not in _TOP]
    general_table = document.get("general", {})
    if not isinstance(general_table, dict):
        raise InputError(f"{path}: [general] must be a table")
    general = _settings(general_table, f"{path}, [general]", warnings)
    datasets = document["datasets"]
    if not isinstance(datasets, list) or not all(isinstance(dataset, dict) for dataset in datasets):
        raise InputError(f"{path}: datasets must be an array of tables: [[datasets]]")
    specs: list[DatasetSpec] = []
    taken: set[str] = set()
    for position, dataset in enumerate(datasets, 1):
        where = f"{path}, [[datasets]] {position}"
        inherited = {**general, **_settings(dataset, where, warnings, ("subsets",))}
        subsets = inherited.pop("subsets", None)
        if not isinstance(subsets, list) or not subsets or not all(isinstance(s, dict) for s in subsets):
            raise InputError(f"{where}: no subsets (each image directory is a [[datasets.subsets]] table)")
        if inherited.get("enable_bucket") is not True:
            warnings.append(
                f"{where}: enable_bucket is not true (kohya's default): kohya crops every image to the resolution's "
                "width x height; stk sorts images into aspect buckets of that area"
            )
        directories: set[str] = set()
        for index, subset in enumerate(subsets, 1):
            spec = _subset(subset, inherited, (path, f"{where}, subset {index}"), taken, directories, warnings)
            if spec is not None:
                specs.append(spec)
    return specs, warnings


_TOP = ("general", "datasets")


def _settings(table: dict[str, Any], where: str, warnings: list[str], own: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings of one level that stk carries (and its `own` keys); the others are warned of here."""
    fields = Fields(table, where, _REASONS)
    settings = {key: fields.take(key) for key in (*_INHERITED, *own) if key in fields.left}
    warnings.extend(fields.rest())
    return settings


def _subset(
    subset: dict[str, Any],
    inherited: dict[str, Any],
    places: tuple[str, str],
    taken: set[str],
    directories: set[str],
    warnings: list[str],
) -> DatasetSpec | None:
    """One subset as an stk dataset; None (with a warning) for one kohya would not train as ordinary images."""
    path, where = places
    directory = subset.get("image_dir")
    if not isinstance(directory, str) or not directory:
        if "metadata_file" not in subset:
            raise InputError(f"{where}: no image_dir")
        warnings.append(f"{where}: no image_dir (a metadata_file of full paths) is not supported by stk; skipped")
        return None
    if subset.get("is_reg") is True:
        warnings.append(f"{where} ({directory}): is_reg: regularisation images are not supported by stk; skipped")
        return None
    if directory in directories:
        warnings.append(f"{where} ({directory}): the same image_dir twice in one dataset, which kohya ignores; skipped")
        return None
    directories.add(directory)
    name = unique_name(dataset_name(re.split(r"[\\/]", directory.rstrip("\\/"))[-1]), taken)
    settings = {**inherited, **_settings(subset, f"{path}, dataset {name!r}", warnings, ("image_dir", "is_reg"))}
    table: dict[str, Any] = {"name": name, "source": directory, **_resolution(settings.get("resolution"), where)}
    if "metadata_file" not in subset:
        # DreamBooth style: the caption file with kohya's extension; an image without one kohya captions with the
        # class_tokens (which stk lacks: it fails here), else with "" (and a warning)
        table["caption-extension"] = _extension(settings.get("caption_extension", _CAPTION_EXTENSION), where)
        table["missing-caption"] = "error" if "class_tokens" in settings else "empty"
    if "class_tokens" in settings:
        warnings.append(f"{path}, dataset {name!r}: class_tokens {_CLASS_TOKENS}")
    # kohya's num_repeats, like stk's repeats, count every pass; its default, 1, said here so that stk's --repeats
    # does not stand in for it
    table["repeats"] = settings.get("num_repeats", 1)
    if "random_crop" in settings:
        table["crop"] = "random" if settings["random_crop"] is True else "center"  # kohya crops at the centre
    if "caption_dropout_rate" in settings:
        table["caption-dropout"] = settings["caption_dropout_rate"]
    return dataset_from_table(table, f"{path}, dataset {name!r}")


def _extension(value: Any, where: str) -> str:
    """kohya's caption_extension as it reads it: ".caption", and "caption" as ".caption"."""
    if not isinstance(value, str):
        raise InputError(f"{where}: caption_extension = {value!r} is not a string")
    return value if value.startswith(".") else "." + value


def _resolution(value: Any, where: str) -> dict[str, Any]:
    """kohya's resolution, one number (a square) or [width, height], is the area its buckets keep: stk's
    area in megapixels (512 -> 0.262144)."""
    if value is None:
        return {}
    sides = value if isinstance(value, list) and len(value) == 2 else [value, value]
    width, height = (number(side, "resolution", where) for side in sides)
    return {"resolution": width * height / 1e6, "resolution-type": "area"}
