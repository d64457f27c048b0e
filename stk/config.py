"""Settings from a TOML file: one table per command (`[scan]`, `[cache]`, ...) plus `[s3]`.

Precedence, highest first: command line, STK_<COMMAND>_<OPTION> environment variable, the
file given with --config, the built-in default (click applies it through `default_map`).
"""

from __future__ import annotations

import sys
from typing import Any

from stk.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["load_command_config", "read_config"]


def read_config(path: str) -> dict[str, Any]:
    """The whole --config file: every command's table, and anything else it holds (stk-scan's `[[dataset]]`)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise InputError(f"--config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"--config {path}: not valid TOML ({exc})") from exc


def load_command_config(path: str, command: str, with_s3: bool = True) -> dict[str, Any]:
    """The `[command]` table with keys as click parameter names, plus the `[s3]` table's values as
    `s3_*` defaults for commands that talk to S3 (`with_s3`; not stk-health, which would reject them)."""
    document = read_config(path)
    table = document.get(command, {})
    if not isinstance(table, dict):
        raise InputError(f"--config {path}: [{command}] must be a table")
    settings = {key.replace("-", "_"): value for key, value in table.items()}
    s3 = document.get("s3", {}) if with_s3 else {}
    for key in ("endpoint_url", "retry_seconds"):
        if isinstance(s3, dict) and key in s3:
            settings.setdefault(f"s3_{key}", s3[key])
    return settings
