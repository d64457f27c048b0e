"""The alert state file: which faults were alerted, when, and whether the alert got through.

One JSON object per node (or per alerting process), rewritten atomically after every run, so a
check from cron every minute can tell a new fault from one it already reported. A damaged file
costs at most one repeated alert, never a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stk import storage
from stk.errors import InputError
from stk.health.report import Finding, Severity
from stk.log import get_logger

__all__ = ["AlertState", "Entry", "locked"]

log = get_logger("health.state")

_VERSION = 1


@dataclass(frozen=True)
class Entry:
    """One fault as last alerted: `severity` is the severity of the last alert tried, `last_alerted`
    the time (epoch seconds) of the last one delivered, None while none got through."""

    finding: Finding
    first_seen: float
    last_alerted: float | None
    severity: Severity
    delivered: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_seen": self.first_seen,
            "last_alerted": self.last_alerted,
            "severity": self.severity.name,
            "message": self.finding.message,
            "delivered": self.delivered,
            "finding": self.finding.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        """Raises KeyError, TypeError or ValueError on a wrong shape."""
        found = dict(data["finding"])
        found["severity"] = Severity[found["severity"]]
        last = data["last_alerted"]
        delivered = data["delivered"]
        if not isinstance(delivered, bool):
            raise TypeError("delivered must be a boolean")
        return cls(
            finding=Finding(**found),
            first_seen=float(data["first_seen"]),
            last_alerted=None if last is None else float(last),
            severity=Severity[data["severity"]],
            delivered=delivered,
        )


@dataclass
class AlertState:
    """Finding key -> Entry."""

    entries: dict[str, Entry] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> AlertState:
        """The state at `path`; empty when the file is missing. A corrupt file (bad JSON, wrong
        shape) gives an empty state and a warning, and is kept as `path + ".corrupt"`."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise InputError(f"alert state {path}: cannot read: {exc.strerror}") from exc
        try:
            return cls._parse(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            storage.write_atomic(path + ".corrupt", data)
            log.warning(
                "alert state %s is corrupt (%s: %s): starting afresh, faults will be alerted again; copy kept in %s",
                path,
                type(exc).__name__,
                exc,
                path + ".corrupt",
            )
            return cls()

    @classmethod
    def _parse(cls, data: bytes) -> AlertState:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != _VERSION or not isinstance(doc.get("alerts"), dict):
            raise ValueError(f"expected {{'version': {_VERSION}, 'alerts': {{...}}}}")
        return cls({str(key): Entry.from_dict(value) for key, value in doc["alerts"].items()})

    def save(self, path: str) -> None:
        """Write the whole state atomically (temp file, fsync, rename)."""
        doc = {"version": _VERSION, "alerts": {key: entry.to_dict() for key, entry in sorted(self.entries.items())}}
        try:
            storage.write_atomic(path, json.dumps(doc, indent=1).encode() + b"\n")
        except OSError as exc:
            raise InputError(f"alert state {path}: cannot write: {exc.strerror}") from exc


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Hold an exclusive lock on `path + ".lock"`, so that runs that overlap (a slow endpoint
    under cron, or cron and the training loop on one node) do not alert twice."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise InputError(f"alert state {path}: cannot lock: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
