"""What the converters of other trainers' dataset configs share: a table read key by key, whose keys left
unread each become one warning line, and stk names made from their ids and folders."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from stk.errors import InputError

__all__ = ["Fields", "dataset_name", "number", "unique_name"]

UNSUPPORTED = "is not supported by stk; ignored"


class Fields:
    """One table of a foreign config: `take` reads a key, `warn` records one line naming the file, the
    dataset and the key, `rest` warns of every key not taken. A key set to null or "" counts as not set."""

    def __init__(self, table: Mapping[str, Any], where: str, reasons: Mapping[str, str]) -> None:
        self.left = {key: value for key, value in table.items() if value is not None and value != ""}
        self.where = where
        self.reasons = reasons  # the warning for a key stk has its own way of doing; default UNSUPPORTED
        self.warnings: list[str] = []

    def take(self, key: str) -> Any:
        return self.left.pop(key, None)

    def warn(self, key: str, why: str) -> None:
        self.warnings.append(f"{self.where}: {key} {why}")

    def rest(self) -> list[str]:
        """Every warning: those recorded, then one per key not taken."""
        for key in list(self.left):
            self.warn(key, self.reasons.get(key, UNSUPPORTED))
        self.left.clear()
        return self.warnings


def number(value: Any, key: str, where: str) -> float:
    """A numeric setting of a foreign config (a bool is not one), for the arithmetic of a conversion."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: {key} = {value!r} is not a number")
    return value


def dataset_name(text: str) -> str:
    """An stk dataset name (letters, digits, '.', '_', '-', starting with a letter or digit) made from an id
    or a folder name: every run of other characters becomes one '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).lstrip("-._").rstrip("-")
    return name or "dataset"


def unique_name(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... when it is taken; the result is added to `taken`."""
    unique, suffix = name, 2
    while unique in taken:
        unique, suffix = f"{name}-{suffix}", suffix + 1
    taken.add(unique)
    return unique
