"""Errors meant for people, each carrying the exit code the command ends with."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from fractions import Fraction

__all__ = [
    "BatchCheckFailed",
    "CacheIncomplete",
    "CheckpointDamaged",
    "ExitCode",
    "InfraError",
    "InputError",
    "PreflightFailed",
    "RankSafeError",
    "StkError",
    "TooManyErrors",
    "check_max_errors",
    "described",
    "parse_max_errors",
]


class ExitCode(enum.IntEnum):
    """Exit codes shared by stk-scan, stk-cache and stk-train (stk-health uses Nagios codes)."""

    OK = 0
    INTERNAL = 1  # a bug: the traceback is in the log
    USAGE = 2  # bad option or argument (click)
    INPUT = 3  # source, table, bucket or output unusable: nothing was produced
    TOO_MANY_ERRORS = 4  # outputs written, but more bad files than --max-errors allows
    BATCH_CHECK = 5  # outputs written, but some bucket cannot fill one effective batch
    INCOMPLETE = 6  # damaged data: a scan table, manifest, shard, checkpoint or trained model's file that cannot be
    # read or verified, or a cache missing samples
    PREFLIGHT = 7  # stk-train: the job cannot run as set up (output not shared, uneven nodes); nothing trained
    DIVERGED = 8  # stk-train: steps kept coming out non-finite (nan/inf): stopped, nothing saved from them
    INFRA = 69  # storage, network or a peer failed (S3 down past the retry budget, disk full): retry, maybe elsewhere
    REQUEUE = 75  # stk-train: checkpointed on SIGUSR2/SIGTERM; requeue the job to continue (EX_TEMPFAIL)
    GPU_FAULT = 76  # stk-train: a GPU fault opened the circuit breaker; drain the node and requeue elsewhere


def _rebuilt(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    """An exception of `cls` holding `args`, made without calling its __init__ (see RankSafeError)."""
    return cls.__new__(cls, *args)


class RankSafeError(Exception):
    """An exception that unpickles whatever its __init__ takes. World sends errors between ranks pickled, and
    Exception's own pickling calls `cls(*self.args)`: a class whose __init__ takes other arguments than it gives
    Exception (ManifestDamaged(location, why) keeps one message) fails to unpickle on the receiving rank, and the
    error path itself raises a TypeError. Here the instance is remade from its args and attributes alone."""

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuilt, (type(self), self.args), self.__dict__


class StkError(RankSafeError):
    """An expected failure: printed as one line (no traceback) and mapped to an exit code."""

    exit_code: ExitCode = ExitCode.INPUT


class InputError(StkError):
    """The input or the output location cannot be used as given."""

    exit_code = ExitCode.INPUT


class InfraError(StkError):
    """The infrastructure failed, not the input: S3 unreachable past the retry budget, a full or
    read-only disk, a peer rank that died. Rerunning (maybe on other nodes) is the fix, so the
    sbatch templates requeue on this code (EX_UNAVAILABLE) and never on INPUT."""

    exit_code = ExitCode.INFRA


class TooManyErrors(StkError):
    exit_code = ExitCode.TOO_MANY_ERRORS


class BatchCheckFailed(StkError):
    exit_code = ExitCode.BATCH_CHECK


class CacheIncomplete(StkError):
    """Data stk wrote is damaged or incomplete (a scan table, a manifest, a shard, or a cache missing
    samples): the message names the file and the command that rebuilds it. Rerunning the job alone
    would meet the same bytes, so it is never requeued."""

    exit_code = ExitCode.INCOMPLETE


class CheckpointDamaged(StkError):
    """No checkpoint to resume from (or to export) matches the digests it was saved with, or a trained model's file
    cannot be read as the format it claims (stk-export of a truncated adapter)."""

    exit_code = ExitCode.INCOMPLETE


class PreflightFailed(StkError):
    exit_code = ExitCode.PREFLIGHT


def described(exc: BaseException) -> str:
    """An exception in one line with its type, for a bad file's error row: a decoder plugin may
    raise anything (Pillow 13's DDS plugin: NotImplementedError), and the type says which it was."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def parse_max_errors(value: str, total: int) -> int:
    """--max-errors (stk-scan, stk-cache): '100' -> 100; '1%' -> 1% of `total` (at least 0)."""
    text = str(value).strip()
    try:
        # exact arithmetic: with floats, 29% of 100 files came out as 28
        limit = int(Fraction(text[:-1]) * total / 100) if text.endswith("%") else int(text)
    except (ValueError, ZeroDivisionError) as exc:
        raise InputError(f"--max-errors {value!r}: give a count (100) or a percentage (1%)") from exc
    if limit < 0:
        raise InputError(f"--max-errors {value!r}: must not be negative")
    return limit


def check_max_errors(value: str, kinds: Mapping[str, int], total: int, what: str, errors_file: str, note: str) -> None:
    """Fail the job (exit 4) when the bad items, counted by kind, exceed --max-errors of `total`."""
    bad = sum(kinds.values())
    limit = parse_max_errors(value, total)
    if bad > limit:
        listed = ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items()))
        raise TooManyErrors(
            f"{bad} {what}, more than --max-errors {value} allows ({limit}): see {errors_file} ({listed}); {note}"
        )
