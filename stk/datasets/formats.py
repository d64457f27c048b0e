"""A dataset list read from a file in whichever format it is: stk's TOML (`[[dataset]]` tables), kohya
sd-scripts' dataset TOML (`[[datasets]]` with subsets) or SimpleTuner's multidatabackend.json (a JSON list).
The format is told from the content, not the file name."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stk.config import read_config
from stk.datasets import kohya, simpletuner
from stk.datasets.spec import DatasetSpec, check_datasets, dataset_from_table
from stk.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ACCEPTED", "Datasets", "datasets_in_config", "read_datasets"]

ACCEPTED = (
    "expected stk's TOML ([[dataset]] tables), kohya's dataset TOML ([[datasets]] with [[datasets.subsets]]) "
    "or SimpleTuner's multidatabackend.json (a JSON list of datasets)"
)


@dataclass(frozen=True)
class Datasets:
    """A list as read: the datasets, one line per setting that was not carried over, and the format."""

    specs: list[DatasetSpec]
    warnings: list[str]
    format: str  # "stk", "kohya" or "simpletuner"


def read_datasets(path: str, warn: Callable[[str], object] | None = None) -> Datasets:
    """The dataset list in `path`, checked (not empty, unique names); InputError (exit 3) for a file that
    cannot be read or is in none of the formats. Each warning is handed to `warn` before the check, so that a
    list whose every entry was skipped says why before the error."""
    document = _document(path)
    if isinstance(document, list):
        specs, warnings = simpletuner.convert(document, path)
        found = Datasets(specs, warnings, "simpletuner")
    elif isinstance(document, dict) and ("dataset" in document) != ("datasets" in document):
        if "datasets" in document:
            specs, warnings = kohya.convert(document, path)
            found = Datasets(specs, warnings, "kohya")
        else:
            found = Datasets(_stk_datasets(document["dataset"], path), [], "stk")
    else:
        raise InputError(f"{path}: no dataset list found; {ACCEPTED}")
    if warn is not None:
        for warning in found.warnings:
            warn(warning)
    if not found.specs and found.warnings:
        raise InputError(f"{path}: no datasets stk can scan: every one was skipped (the warning lines say why)")
    check_datasets(found.specs, path)
    return found


def datasets_in_config(path: str) -> list[DatasetSpec] | None:
    """The `[[dataset]]` tables of a `--config` TOML, checked; None when it has none."""
    where = f"--config {path}"
    document = read_config(path)
    if "dataset" not in document:
        return None
    specs = _stk_datasets(document["dataset"], where)
    check_datasets(specs, where)
    return specs


def _stk_datasets(tables: Any, where: str) -> list[DatasetSpec]:
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise InputError(f"{where}: dataset must be an array of tables: write each one as [[dataset]]")
    return [dataset_from_table(table, f"{where}, dataset {number}") for number, table in enumerate(tables, 1)]


def _document(path: str) -> Any:
    """The file as JSON, or else as TOML; its name does not matter. Invalid in both: the error of the one
    its text opens like (JSON: '{', or '[' then '{', '"' or ']'; TOML tables open with '[' too)."""
    text = _read(path, path, f"; {ACCEPTED}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        opening = text.lstrip()
        if opening[:1] == "{" or (opening[:1] == "[" and opening[1:].lstrip()[:1] in ("{", '"', "]")):
            raise InputError(f"{path}: not valid JSON ({exc}); {ACCEPTED}") from exc
    return _toml(text, path, f"; {ACCEPTED}")


def _read(path: str, where: str, expected: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InputError(f"{where}: cannot be read ({exc.strerror or exc}){expected}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text ({exc.reason}){expected}") from exc


def _toml(text: str, where: str, expected: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where}: not valid TOML ({exc}){expected}") from exc
