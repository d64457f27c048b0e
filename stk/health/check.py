"""One health check of this node: sample the GPUs, apply the rules, and say the outcome two ways
(JSON lines for logs and tools, one text line for people, Nagios and Slurm's Reason=)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence

from stk.cluster.slurm import gpus_per_node, job_id
from stk.health.devices import DeviceBackend, NoDriver, NvmlFailed
from stk.health.report import Finding, GpuSample, Report, Severity
from stk.health.rules import Thresholds, evaluate

__all__ = ["expected_gpus_from_env", "report_json_lines", "report_text", "run_check"]


def expected_gpus_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """GPUs this node should show: the job's GPUs per node; None outside Slurm (the gpu_count rule
    is then skipped)."""
    return gpus_per_node(os.environ if environ is None else environ)


def run_check(
    backend: DeviceBackend,
    expected_gpus: int | None,
    thresholds: Thresholds,
    previous: Sequence[GpuSample] | None = None,
) -> Report:
    """Check this node once. No driver is UNKNOWN (cannot tell); NVML failing outright is CRITICAL."""
    host, job = socket.gethostname(), job_id(os.environ)
    try:
        samples = backend.sample()
    except NoDriver as exc:
        finding = Finding("no_driver", Severity.UNKNOWN, f"no NVIDIA driver: {exc}")
        return Report(host, job, 0, (finding,))
    except NvmlFailed as exc:
        finding = Finding("gpu_unresponsive", Severity.CRITICAL, f"NVML does not answer: {exc}")
        return Report(host, job, 0, (finding,))
    findings = evaluate(samples, expected_gpus, thresholds, previous)
    return Report(host, job, len(samples), tuple(findings), tuple(samples))


def report_json_lines(report: Report) -> str:
    """One JSON object per finding, then one summary object; ends with a newline."""
    lines = [json.dumps({"host": report.host, **f.to_dict()}) for f in report.findings]
    summary = {
        "summary": True,
        "host": report.host,
        "job_id": report.job_id,
        "gpus": report.gpus,
        "severity": report.severity.name,
        "exit_code": int(report.severity),
    }
    lines.append(json.dumps(summary))
    return "\n".join(lines) + "\n"


def report_text(report: Report) -> str:
    """One line, worst first: "OK: 8 GPUs healthy" or "CRITICAL: GPU 3 (...): ...; GPU 5 (...): ..."."""
    if not report.findings:
        return f"OK: {report.gpus} GPUs healthy"
    worst_first = sorted(report.findings, key=lambda f: -f.severity)
    return f"{report.severity.name}: " + "; ".join(f.message for f in worst_first)
