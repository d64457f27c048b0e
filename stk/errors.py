"""Errors meant for people, each carrying the exit code the command ends with."""

from __future__ import annotations

import enum

__all__ = ["BatchCheckFailed", "CacheIncomplete", "ExitCode", "InputError", "StkError", "TooManyErrors"]


class ExitCode(enum.IntEnum):
    """Exit codes shared by stk-scan, stk-cache and stk-train (stk-health uses Nagios codes)."""

    OK = 0
    INTERNAL = 1  # a bug: the traceback is in the log
    USAGE = 2  # bad option or argument (click)
    INPUT = 3  # source, table, bucket or output unusable: nothing was produced
    TOO_MANY_ERRORS = 4  # outputs written, but more bad files than --max-errors allows
    BATCH_CHECK = 5  # outputs written, but some bucket cannot fill one effective batch
    INCOMPLETE = 6  # stk-cache verify: shards missing or damaged, or scan rows without a cache entry


class StkError(Exception):
    """An expected failure: printed as one line (no traceback) and mapped to an exit code."""

    exit_code: ExitCode = ExitCode.INPUT


class InputError(StkError):
    """The input or the output location cannot be used as given."""

    exit_code = ExitCode.INPUT


class TooManyErrors(StkError):
    exit_code = ExitCode.TOO_MANY_ERRORS


class BatchCheckFailed(StkError):
    exit_code = ExitCode.BATCH_CHECK


class CacheIncomplete(StkError):
    exit_code = ExitCode.INCOMPLETE
