"""A dataset list as stk's TOML: the `[[dataset]]` tables `stk-scan --print-config` prints and `read_datasets`
reads back to the same specs. Written here because tomllib only reads; the tables are flat (str, int, float)."""

from __future__ import annotations

from collections.abc import Sequence

from stk.datasets.spec import DatasetSpec

__all__ = ["datasets_toml"]

# TOML basic strings: these have short escapes; any other control character is written \\uXXXX.
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def datasets_toml(specs: Sequence[DatasetSpec]) -> str:
    """One `[[dataset]]` table per spec, in order, with the fields it gives."""
    tables = []
    for spec in specs:
        lines = ["[[dataset]]"] + [f"{key} = {_value(value)}" for key, value in spec.toml_table().items()]
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def _value(value: str | int | float) -> str:
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(char) or _control(char) for char in value) + '"'
    if isinstance(value, bool):  # no field is one; a bool would be written as an int otherwise
        raise TypeError(f"no TOML for {value!r} in a dataset table")
    return repr(value)  # int; float: the shortest repr reads back to the same float (inf, nan are TOML too)


def _control(char: str) -> str:
    return f"\\u{ord(char):04X}" if ord(char) < 0x20 or ord(char) == 0x7F else char
