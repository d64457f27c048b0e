"""Errors meant for people, each carrying the exit code the command ends with."""

from __future__ import annotations

import enum

__all__ = [
    "BatchCheckFailed",
    "CacheIncomplete",
    "ExitCode",
    "InputError",
    "PreflightFailed",
    "StkError",
    "TooManyErrors",
]


class ExitCode(enum.IntEnum):
    """Exit codes shared by stk-scan, stk-cache and stk-train (stk-health uses Nagios codes)."""

    OK = 0
    INTERNAL = 1  # a bug: the traceback is in the log
    USAGE = 2  # bad option or argument (click)
    INPUT = 3  # source, table, bucket or output unusable: nothing was produced
    TOO_MANY_ERRORS = 4  # outputs written, but more bad files than --max-errors allows
    BATCH_CHECK = 5  # outputs written, but some bucket cannot fill one effective batch
    INCOMPLETE = 6  # stk-cache verify: shards missing or damaged, or scan rows without a cache entry
    PREFLIGHT = 7  # stk-train: the job cannot run as set up (output not shared, uneven nodes); nothing trained
    REQUEUE = 75  # stk-train: checkpointed on SIGUSR2/SIGTERM; requeue the job to continue (EX_TEMPFAIL)
    GPU_FAULT = 76  # stk-train: a GPU fault opened the circuit breaker; drain the node and requeue elsewhere


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


class PreflightFailed(StkError):
    exit_code = ExitCode.PREFLIGHT
