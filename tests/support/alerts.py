"""Findings, reports and alert states for the tests of stk.health.alerts and stk.health.state."""

from __future__ import annotations

from stk.health.report import Finding, Report, Severity
from stk.health.state import AlertState, Entry

T0 = 1_700_000_000.0

HOUR = 3600.0


def ecc(severity: Severity = Severity.CRITICAL, gpu: int = 3, value: int = 2) -> Finding:
    return Finding(
        check="ecc_volatile_uncorrectable",
        severity=severity,
        message=f"volatile uncorrectable ECC errors: {value}",
        gpu_index=gpu,
        gpu_uuid=f"GPU-0000000{gpu}",
        gpu_name="NVIDIA H100 80GB HBM3",
        value=value,
        threshold=0,
    )


def report(*findings: Finding) -> Report:
    return Report(host="gpu-node-07", job_id="4242", gpus=8, findings=findings)


def entry(finding: Finding, last_alerted: float | None = T0, delivered: bool = True) -> Entry:
    return Entry(finding, first_seen=T0, last_alerted=last_alerted, severity=finding.severity, delivered=delivered)


def state_of(*entries: Entry) -> AlertState:
    return AlertState({e.finding.key: e for e in entries})
