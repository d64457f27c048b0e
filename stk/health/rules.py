"""The health rules: GPU readings in, findings out (pure, no I/O), with thresholds a site can tune.

Critical findings mean "drain this node"; warnings mean "look at it". PCIe links slow down
(lower generation) at idle on many GPUs to save power, so a lower generation is only a warning
while the GPU is known to be busy; a narrower link than the maximum is a warning at any load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stk.errors import InputError
from stk.health.report import Finding, GpuSample, Severity

__all__ = ["CLOCK_HW_SLOWDOWN", "CLOCK_POWER_BRAKE", "CLOCK_THERMAL", "XID_CRITICAL", "Thresholds", "evaluate"]

# XIDs after which the GPU needs a reset or repair, not just a restart of the application.
XID_CRITICAL: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# Not listed: 94 (contained ECC error) ends only the application using the memory; the pending
# row remap it leaves is caught by the row_remap rule. 13, 31, 43, 45 are usually application bugs.

# NVML clocks event (throttle) reason bits. SW power cap (0x4) under full load is normal.
CLOCK_HW_SLOWDOWN = 0x8
CLOCK_THERMAL = 0x20 | 0x40  # SW thermal slowdown, HW thermal slowdown
CLOCK_POWER_BRAKE = 0x80


@dataclass(frozen=True)
class Thresholds:
    """Limits the rules compare against; a site overrides them in [health.thresholds]."""

    temperature_critical_margin: int = 5  # °C below the GPU's own shutdown temperature
    temperature_warning_margin: int = 10
    retired_pages_warning: int = 60  # retired pages (single + double bit); the limit is 64 on most GPUs
    xid_critical: frozenset[int] = field(default_factory=lambda: frozenset(XID_CRITICAL))

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> Thresholds:
        """Thresholds from a TOML table; unknown keys and wrong types are errors, not ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key.replace("-", "_"): value for key, value in table.items()}
        unknown = sorted(set(values) - names)
        if unknown:
            known = ", ".join(sorted(names))
            raise InputError(f"[health.thresholds]: unknown key(s) {', '.join(unknown)} (known: {known})")
        for key, value in values.items():
            if key == "xid_critical":
                if not isinstance(value, list | tuple | set | frozenset) or not all(_is_int(v) for v in value):
                    raise InputError(f"[health.thresholds]: {key} must be a list of XID numbers")
                values[key] = frozenset(value)
            elif not _is_int(value) or value < 0:
                raise InputError(f"[health.thresholds]: {key} must be a whole number >= 0, not {value!r}")
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def evaluate(
    samples: Sequence[GpuSample],
    expected_gpus: int | None,
    thresholds: Thresholds,
    previous: Sequence[GpuSample] | None = None,
) -> list[Finding]:
    """Every finding for one node. `previous` is the last check's samples (for two-sample rules)."""
    findings = []
    if expected_gpus is not None and len(samples) < expected_gpus:
        findings.append(
            Finding(
                "gpu_count",
                Severity.CRITICAL,
                f"{len(samples)} GPUs visible, {expected_gpus} expected",
                value=len(samples),
                threshold=expected_gpus,
            )
        )
    before = {s.uuid or s.index: s for s in previous or ()}
    for sample in samples:
        findings.extend(_gpu_findings(sample, before.get(sample.uuid or sample.index), thresholds))
    return findings


def _gpu_findings(s: GpuSample, before: GpuSample | None, t: Thresholds) -> list[Finding]:
    found: list[Finding] = []

    def add(check: str, severity: Severity, what: str, value: Any = None, threshold: Any = None) -> None:
        gpu = f"GPU {s.index} ({s.uuid})" if s.uuid else f"GPU {s.index}"
        uuid, name = s.uuid or None, s.name or None
        found.append(Finding(check, severity, f"{gpu}: {what}", s.index, uuid, name, value, threshold))

    if not s.answered:
        add("gpu_unresponsive", Severity.CRITICAL, f"does not answer ({s.error or 'no reason given'})", s.error)
        return found
    if s.ecc_volatile_uncorrectable:
        count = s.ecc_volatile_uncorrectable
        add("ecc_uncorrectable", Severity.CRITICAL, f"volatile uncorrectable ECC errors {count} > 0", count, 0)
    if s.remap_failure:
        add("row_remap", Severity.CRITICAL, "row remapping failed (no spare rows left)", "failure")
    elif s.remap_pending:
        add("row_remap", Severity.CRITICAL, "row remap pending (GPU reset needed)", "pending")
    if s.temperature is not None and s.shutdown_temperature:
        margin = s.shutdown_temperature - s.temperature
        what = f"temperature {s.temperature} °C, {margin} °C below shutdown at {s.shutdown_temperature} °C"
        critical, warning = t.temperature_critical_margin, t.temperature_warning_margin
        if margin <= critical:
            add("temperature", Severity.CRITICAL, what, s.temperature, s.shutdown_temperature - critical)
        elif margin <= warning:
            add("temperature", Severity.WARNING, what, s.temperature, s.shutdown_temperature - warning)
    xids = sorted(set(s.xids) & t.xid_critical)
    if xids:
        named = ", ".join(f"{x} ({XID_CRITICAL.get(x, 'critical')})" for x in xids)
        add("xid", Severity.CRITICAL, f"XID {named}", xids)
    if s.nvlink_active and not all(s.nvlink_active):
        down = [link for link, active in enumerate(s.nvlink_active) if not active]
        add("nvlink", Severity.CRITICAL, f"NVLink down: link(s) {', '.join(map(str, down))}", down)
    reasons = s.clock_event_reasons or 0
    if reasons & CLOCK_HW_SLOWDOWN and before is not None and (before.clock_event_reasons or 0) & CLOCK_HW_SLOWDOWN:
        add("clock_hw_slowdown", Severity.WARNING, "hardware clock slowdown on two consecutive checks", hex(reasons))
    if reasons & CLOCK_THERMAL:
        add("clock_thermal", Severity.WARNING, "thermal clock slowdown", hex(reasons))
    if reasons & CLOCK_POWER_BRAKE:
        add("clock_power_brake", Severity.WARNING, "power-brake clock slowdown", hex(reasons))
    narrow = s.pcie_width is not None and s.pcie_width_max is not None and s.pcie_width < s.pcie_width_max
    busy = s.utilization is not None and s.utilization > 0
    slow = busy and s.pcie_gen is not None and s.pcie_gen_max is not None and s.pcie_gen < s.pcie_gen_max
    if narrow or slow:
        link = f"PCIe link gen {s.pcie_gen} x{s.pcie_width}, max gen {s.pcie_gen_max} x{s.pcie_width_max}"
        add("pcie_link", Severity.WARNING, link, [s.pcie_gen, s.pcie_width], [s.pcie_gen_max, s.pcie_width_max])
    retired = (s.retired_pages_sbe or 0) + (s.retired_pages_dbe or 0)
    if retired >= t.retired_pages_warning:
        what = f"{retired} retired pages (warning at {t.retired_pages_warning})"
        add("retired_pages", Severity.WARNING, what, retired, t.retired_pages_warning)
    elif s.retired_pages_pending:
        add("retired_pages", Severity.WARNING, "page retirement pending (GPU reset needed)", "pending")
    return found
