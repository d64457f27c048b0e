"""What a health check reads from the GPUs and what it concludes, shared by checks, alerts and state.

Plain frozen dataclasses with no dependencies, so that every part of stk-health (and the
training circuit breaker later) can import them without loading anything heavy.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Finding", "GpuSample", "Report", "Severity"]


class Severity(enum.IntEnum):
    """How bad a finding is; the values are the Nagios exit codes, so the worst one is the exit status."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


@dataclass(frozen=True)
class Finding:
    """One rule that fired on one GPU (or on the node), with a message fit for Slurm's Reason=."""

    check: str
    severity: Severity
    message: str
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    gpu_name: str | None = None
    value: Any = None
    threshold: Any = None

    @property
    def key(self) -> str:
        """Stable identity across runs, so alert state can tell a new fault from a persisting one."""
        if self.gpu_uuid:
            where = self.gpu_uuid
        elif self.gpu_index is not None:
            where = str(self.gpu_index)
        else:
            where = "node"
        return f"{self.check}:{where}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; the severity is written by name."""
        data = dataclasses.asdict(self)
        data["severity"] = self.severity.name
        return data


@dataclass(frozen=True)
class GpuSample:
    """One GPU's readings at one moment; None where the device cannot tell (not supported)."""

    index: int
    uuid: str
    name: str
    answered: bool = True
    error: str | None = None
    temperature: int | None = None
    shutdown_temperature: int | None = None
    slowdown_temperature: int | None = None
    ecc_volatile_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    clock_event_reasons: int | None = None  # NVML clocks event (throttle) reasons bitmask
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_active: tuple[bool, ...] | None = None
    xids: tuple[int, ...] = ()  # XID events seen since the last sample
    utilization: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists); GpuSample.from_dict reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuSample:
        """Read a sample written by to_dict or a test script; unknown keys are an error (typos)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPU sample field(s): {', '.join(unknown)}")
        values = dict(data)
        if values.get("nvlink_active") is not None:
            values["nvlink_active"] = tuple(bool(v) for v in values["nvlink_active"])
        values["xids"] = tuple(int(v) for v in values.get("xids") or ())
        return cls(**values)


@dataclass(frozen=True)
class Report:
    """The outcome of one check of one node; `samples` are the readings it judged, kept so the caller
    can store them as `previous` for the next check (rules that need two consecutive samples)."""

    host: str
    job_id: str | None
    gpus: int
    findings: tuple[Finding, ...]
    samples: tuple[GpuSample, ...] = ()

    @property
    def severity(self) -> Severity:
        """The worst finding's severity, OK when nothing fired."""
        return max((f.severity for f in self.findings), default=Severity.OK)
