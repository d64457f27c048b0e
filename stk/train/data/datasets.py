"""The datasets of a run, as stk-train uses them: read from a combined scan's buckets.json (its "datasets" list), the
weights the sampler draws by, each dataset's caption dropout, and the record a checkpoint keeps of them, so that a
resume with another list is refused naming what changed. A run of one source has no datasets: an empty list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stk.errors import InputError

__all__ = [
    "DATASETS",
    "RunDataset",
    "caption_dropouts",
    "dataset_changes",
    "dataset_settings",
    "run_datasets",
    "setting_changes",
    "weights_of",
]

DATASETS = "datasets"  # the run setting (stk-run.json) that records them
_COMPARED = ("repeats", "weight", "caption_dropout")  # what a resume compares of each dataset, beside its name


@dataclass(frozen=True)
class RunDataset:
    name: str
    repeats: int  # the dataset's own; a bucket's entry may raise it (--allow-oversubscription)
    weight: float | None  # None: the run draws by repeats (buckets.json "weighted" false)
    caption_dropout: float | None  # None: --caption-dropout


def run_datasets(document: Mapping[str, Any], where: str) -> list[RunDataset]:
    """buckets.json's datasets in the list's order (a dataset without a weight weighs 1.0 where any has one); [] for
    the scan of one source. InputError (exit 3) naming `where` for a list stk-scan did not write."""
    listed = document.get("datasets")
    if listed is None:
        return []
    weighted = bool(document.get("weighted"))
    try:
        datasets = [_dataset(entry, weighted) for entry in listed]
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f'{where}: its "datasets" are not stk-scan\'s ({exc}); scan again with stk-scan') from None
    names = [d.name for d in datasets]
    if not datasets or len(set(names)) != len(names):
        raise InputError(f'{where}: its "datasets" list is empty or names a dataset twice; scan again with stk-scan')
    return datasets


def _dataset(entry: Mapping[str, Any], weighted: bool) -> RunDataset:
    weight = entry.get("weight")
    dropout = entry.get("caption_dropout")
    dataset = RunDataset(
        name=str(entry["name"]),
        repeats=int(entry["repeats"]),
        weight=(1.0 if weight is None else float(weight)) if weighted else None,
        caption_dropout=None if dropout is None else float(dropout),
    )
    if dataset.repeats < 1 or (dataset.weight is not None and not dataset.weight > 0):
        raise ValueError(f"dataset {dataset.name!r}: repeats {dataset.repeats}, weight {dataset.weight}")
    if dataset.caption_dropout is not None and not 0 <= dataset.caption_dropout <= 1:
        raise ValueError(f"dataset {dataset.name!r}: caption_dropout {dataset.caption_dropout} is not in [0, 1]")
    return dataset


def weights_of(datasets: Sequence[RunDataset]) -> dict[str, float] | None:
    """Dataset name -> weight for the sampler's weighted draw; None: an epoch by repeats."""
    if not any(d.weight is not None for d in datasets):
        return None
    return {d.name: d.weight for d in datasets if d.weight is not None}


def caption_dropouts(datasets: Sequence[RunDataset], default: float) -> dict[str, float]:
    """Dataset name -> the share of its samples trained on the empty caption (its own, else `default`)."""
    return {d.name: default if d.caption_dropout is None else d.caption_dropout for d in datasets}


def dataset_settings(datasets: Sequence[RunDataset]) -> list[dict[str, Any]]:
    """What a checkpoint records of the datasets (stk-run.json's "datasets"); [] for a run of one source."""
    return [{"name": d.name, **{key: getattr(d, key) for key in _COMPARED}} for d in datasets]


def dataset_changes(saved: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]) -> list[str]:
    """How the recorded dataset list differs from this run's, a phrase a change ("dataset 'style': repeats 10 -> 5",
    "dataset 'photos' added"); the order of the list is no change (the sampler draws by name)."""
    before = {str(d.get("name")): d for d in saved}
    after = {str(d.get("name")): d for d in current}
    changes = [f"dataset {name!r} removed" for name in before if name not in after]
    changes += [f"dataset {name!r} added" for name in after if name not in before]
    for name in (name for name in after if name in before):
        changes += [
            f"dataset {name!r}: {key.replace('_', '-')} {before[name].get(key)} -> {after[name].get(key)}"
            for key in _COMPARED
            if before[name].get(key) != after[name].get(key)
        ]
    return changes


def setting_changes(key: str, saved: Any, current: Any) -> list[str]:
    """How one run setting changed, as a resume's refusal names it ("seed 0 -> 1", or each change of the datasets);
    [] where it did not."""
    if key == DATASETS:
        return dataset_changes(saved, current)
    return [] if saved == current else [f"{key.replace('_', '-')} {saved} -> {current}"]
