"""One health pass as cron, Slurm and the node daemon run it: check, remember the samples (the
hardware-slowdown rule compares two passes), alert on change, drain or resume the node."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from stk import storage
from stk.health.check import run_check
from stk.health.devices import DeviceBackend
from stk.health.report import GpuSample, Report
from stk.health.rules import Thresholds
from stk.log import get_logger

__all__ = ["HealthPass", "PassSettings", "default_state_path"]

log = get_logger("health")


def default_state_path() -> str:
    """/var/lib/stk-health for root (cron, Slurm), else the user's cache directory."""
    if os.geteuid() == 0:
        return "/var/lib/stk-health/state.json"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "stk-health", "state.json")


@dataclass(frozen=True)
class PassSettings:
    expected_gpus: int | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    notify: tuple[str, ...] = ()
    notify_config: str | None = None
    state_path: str = field(default_factory=default_state_path)
    realert_hours: float = 4.0
    drain: bool = False


class HealthPass:
    """Runs passes with one device backend, so a long-running watch keeps its NVML event set
    (XID events arrive only while it is registered) and its previous samples in memory."""

    def __init__(self, backend: DeviceBackend, settings: PassSettings) -> None:
        self.backend = backend
        self.settings = settings
        self._samples_path = settings.state_path + ".samples"
        self._previous = self._load_samples()

    def _load_samples(self) -> list[GpuSample] | None:
        try:
            data = json.loads(storage.read_bytes(self._samples_path))
            return [GpuSample.from_dict(d) for d in data]
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError):
            log.warning("ignoring unreadable %s: the two-sample rules start afresh", self._samples_path)
            return None

    def run(self) -> Report:
        s = self.settings
        report = run_check(self.backend, s.expected_gpus, s.thresholds, self._previous)
        self._previous = list(report.samples)
        try:
            data = json.dumps([sample.to_dict() for sample in report.samples]).encode()
            storage.write_atomic(self._samples_path, data)
        except OSError as exc:
            log.warning("cannot save %s: %s", self._samples_path, exc.strerror or exc)
        if s.notify or s.notify_config:
            from stk.health.alerts import notify_report

            notify_report(report, s.state_path, list(s.notify), s.notify_config, s.realert_hours)
        if s.drain:
            from stk.health.slurm import apply_drain_policy, default_node_name

            action = apply_drain_policy(report, default_node_name())
            log.info("slurm: %s", action)
        return report
