"""stk.health rules and reports: each rule's fault, warning and clearing, thresholds from a table,
and the JSON-lines and one-line text outputs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from stk.errors import InputError
from stk.health.check import expected_gpus_from_env, report_json_lines, report_text, run_check
from stk.health.report import Finding, GpuSample, Report, Severity
from stk.health.rules import Thresholds, evaluate

DEFAULTS = Thresholds()


def healthy(index: int = 0, **changes: Any) -> GpuSample:
    """A busy, healthy H100 as NVML reports it (no page retirement on H100: row remapping instead)."""
    sample = GpuSample(
        index=index,
        uuid=f"GPU-{index:08x}",
        name="NVIDIA H100 80GB HBM3",
        temperature=60,
        shutdown_temperature=92,
        slowdown_temperature=89,
        ecc_volatile_uncorrectable=0,
        remap_pending=False,
        remap_failure=False,
        clock_event_reasons=0x4,  # power cap at full load: normal
        pcie_gen=5,
        pcie_gen_max=5,
        pcie_width=16,
        pcie_width_max=16,
        nvlink_active=(True,) * 18,
        utilization=100,
    )
    return dataclasses.replace(sample, **changes)


def node(**changes: Any) -> list[GpuSample]:
    """Eight healthy GPUs, GPU 3 changed as given."""
    return [healthy(i, **(changes if i == 3 else {})) for i in range(8)]


def checks(findings: list[Finding]) -> list[tuple[str, Severity, int | None]]:
    return [(f.check, f.severity, f.gpu_index) for f in findings]


def test_a_healthy_node_has_no_findings() -> None:
    assert evaluate(node(), 8, DEFAULTS, previous=node()) == []


FAULTS = [
    ({"answered": False, "error": "GPU is lost"}, "gpu_unresponsive", Severity.CRITICAL),
    ({"ecc_volatile_uncorrectable": 2}, "ecc_uncorrectable", Severity.CRITICAL),
    ({"remap_pending": True}, "row_remap", Severity.CRITICAL),
    ({"remap_failure": True}, "row_remap", Severity.CRITICAL),
    ({"temperature": 88}, "temperature", Severity.CRITICAL),
    ({"temperature": 82}, "temperature", Severity.WARNING),
    ({"xids": (79,)}, "xid", Severity.CRITICAL),
    ({"xids": (13, 95)}, "xid", Severity.CRITICAL),
    ({"nvlink_active": (True,) * 5 + (False,) + (True,) * 12}, "nvlink", Severity.CRITICAL),
    ({"clock_event_reasons": 0x20}, "clock_thermal", Severity.WARNING),
    ({"clock_event_reasons": 0x40}, "clock_thermal", Severity.WARNING),
    ({"clock_event_reasons": 0x80}, "clock_power_brake", Severity.WARNING),
    ({"pcie_width": 8}, "pcie_link", Severity.WARNING),
    ({"pcie_gen": 3}, "pcie_link", Severity.WARNING),
    ({"retired_pages_sbe": 40, "retired_pages_dbe": 20}, "retired_pages", Severity.WARNING),
    (
        {"retired_pages_sbe": 0, "retired_pages_dbe": 0, "retired_pages_pending": True},
        "retired_pages",
        Severity.WARNING,
    ),
]


@pytest.mark.parametrize(("changes", "check", "severity"), FAULTS, ids=[f"{c}-{s.name}" for _, c, s in FAULTS])
def test_each_rule_fires_on_its_fault_and_clears(changes: dict[str, Any], check: str, severity: Severity) -> None:
    faulty = node(**changes)
    findings = evaluate(faulty, 8, DEFAULTS, previous=node())
    assert checks(findings) == [(check, severity, 3)]
    finding = findings[0]
    assert finding.message.startswith("GPU 3 (GPU-00000003): ")
    assert finding.key == f"{check}:GPU-00000003"
    assert finding.gpu_name == "NVIDIA H100 80GB HBM3"
    # the next healthy sample clears it, whatever came before
    assert evaluate(node(), 8, DEFAULTS, previous=faulty) == []


def test_just_outside_the_margins_is_healthy() -> None:
    assert evaluate(node(temperature=81), 8, DEFAULTS) == []  # 11 °C below shutdown
    assert evaluate(node(retired_pages_sbe=59, retired_pages_dbe=0), 8, DEFAULTS) == []


def test_ecc_message_gives_count_and_limit() -> None:
    (finding,) = evaluate(node(ecc_volatile_uncorrectable=2), 8, DEFAULTS)
    assert finding.message == "GPU 3 (GPU-00000003): volatile uncorrectable ECC errors 2 > 0"
    assert (finding.value, finding.threshold) == (2, 0)


def test_missing_gpus_are_critical_for_the_node() -> None:
    (finding,) = evaluate(node()[:7], 8, DEFAULTS)
    assert (finding.check, finding.severity, finding.gpu_index, finding.key) == (
        "gpu_count",
        Severity.CRITICAL,
        None,
        "gpu_count:node",
    )
    assert finding.message == "7 GPUs visible, 8 expected"
    assert evaluate(node(), 8, DEFAULTS) == []
    assert evaluate(node(), None, DEFAULTS) == []  # nothing expected: nothing to compare


def test_unknown_readings_are_skipped() -> None:
    blank = [GpuSample(index=i, uuid=f"GPU-{i}", name="NVIDIA H100") for i in range(8)]
    assert evaluate(blank, 8, DEFAULTS) == []
    # temperature without a shutdown threshold from the device: no guess
    assert evaluate([healthy(temperature=120, shutdown_temperature=None)], 1, DEFAULTS) == []


def test_a_gpu_that_does_not_answer_gets_only_that_finding() -> None:
    findings = evaluate(node(answered=False, error="GPU is lost", ecc_volatile_uncorrectable=5), 8, DEFAULTS)
    assert checks(findings) == [("gpu_unresponsive", Severity.CRITICAL, 3)]
    assert "GPU is lost" in findings[0].message


def test_hw_slowdown_needs_two_consecutive_samples() -> None:
    slow = node(clock_event_reasons=0x8 | 0x4)
    assert evaluate(slow, 8, DEFAULTS, previous=None) == []
    assert evaluate(slow, 8, DEFAULTS, previous=node()) == []
    assert checks(evaluate(slow, 8, DEFAULTS, previous=slow)) == [("clock_hw_slowdown", Severity.WARNING, 3)]
    assert evaluate(node(), 8, DEFAULTS, previous=slow) == []
    # matched by UUID, not position: GPU 3's slowdown then another GPU's is not two in a row
    other = [healthy(i, clock_event_reasons=0x8 if i == 4 else 0) for i in range(8)]
    assert evaluate(other, 8, DEFAULTS, previous=slow) == []


def test_power_cap_and_idle_reasons_are_normal() -> None:
    assert evaluate(node(clock_event_reasons=0x4), 8, DEFAULTS, previous=node(clock_event_reasons=0x4)) == []
    assert evaluate(node(clock_event_reasons=0x1), 8, DEFAULTS) == []


def test_pcie_gen_below_max_at_idle_is_normal_but_narrow_is_not() -> None:
    assert evaluate(node(pcie_gen=1, utilization=0), 8, DEFAULTS) == []
    assert evaluate(node(pcie_gen=1, utilization=None), 8, DEFAULTS) == []
    (finding,) = evaluate(node(pcie_width=8, utilization=0), 8, DEFAULTS)
    assert finding.message == "GPU 3 (GPU-00000003): PCIe link gen 5 x8, max gen 5 x16"


def test_gpus_without_nvlink_are_fine() -> None:
    assert evaluate(node(nvlink_active=None), 8, DEFAULTS) == []
    assert evaluate(node(nvlink_active=()), 8, DEFAULTS) == []


def test_non_critical_xids_are_ignored() -> None:
    assert evaluate(node(xids=(13, 31, 43, 94)), 8, DEFAULTS) == []


def test_several_findings_on_several_gpus() -> None:
    samples = [healthy(i) for i in range(8)]
    samples[1] = healthy(1, ecc_volatile_uncorrectable=1, clock_event_reasons=0x80)
    samples[5] = healthy(5, xids=(48,))
    assert checks(evaluate(samples, 8, DEFAULTS)) == [
        ("ecc_uncorrectable", Severity.CRITICAL, 1),
        ("clock_power_brake", Severity.WARNING, 1),
        ("xid", Severity.CRITICAL, 5),
    ]


# --- thresholds ---------------------------------------------------------------------------------


def test_thresholds_from_a_table() -> None:
    table = {"temperature-critical-margin": 2, "retired_pages_warning": 10, "xid_critical": [79, 13]}
    thresholds = Thresholds.from_dict(table)
    assert thresholds == Thresholds(
        temperature_critical_margin=2, retired_pages_warning=10, xid_critical=frozenset({79, 13})
    )
    assert checks(evaluate(node(temperature=88), 8, thresholds)) == [("temperature", Severity.WARNING, 3)]
    assert checks(evaluate(node(xids=(13,)), 8, thresholds)) == [("xid", Severity.CRITICAL, 3)]
    assert evaluate(node(xids=(48,)), 8, thresholds) == []
    assert checks(evaluate(node(retired_pages_sbe=10), 8, thresholds)) == [("retired_pages", Severity.WARNING, 3)]
    assert Thresholds.from_dict({}) == DEFAULTS


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"temprature_critical_margin": 3}, "unknown key(s) temprature_critical_margin"),
        ({"retired_pages_warning": "60"}, "retired_pages_warning must be a whole number"),
        ({"temperature_warning_margin": True}, "temperature_warning_margin must be a whole number"),
        ({"xid_critical": 79}, "xid_critical must be a list of XID numbers"),
    ],
)
def test_bad_threshold_tables_are_rejected(table: dict[str, Any], error: str) -> None:
    with pytest.raises(InputError, match=error.replace("(", r"\(").replace(")", r"\)")):
        Thresholds.from_dict(table)


# --- reports ------------------------------------------------------------------------------------


class Fixed:
    def __init__(self, samples: list[GpuSample]) -> None:
        self.samples = samples

    def sample(self) -> list[GpuSample]:
        return self.samples


def test_report_of_a_healthy_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    report = run_check(Fixed(node()), 8, DEFAULTS)
    assert (report.job_id, report.gpus, report.findings, report.severity) == ("4242", 8, (), Severity.OK)
    assert report.samples == tuple(node())
    assert report_text(report) == "OK: 8 GPUs healthy"
    (line,) = report_json_lines(report).splitlines()
    assert json.loads(line) == {
        "summary": True,
        "host": report.host,
        "job_id": "4242",
        "gpus": 8,
        "severity": "OK",
        "exit_code": 0,
    }


def test_report_of_a_faulty_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    samples = node(clock_event_reasons=0x20)
    samples[5] = healthy(5, remap_pending=True)
    report = run_check(Fixed(samples), 8, DEFAULTS)
    assert report.severity == Severity.CRITICAL
    assert report_text(report) == (
        "CRITICAL: GPU 5 (GPU-00000005): row remap pending (GPU reset needed); "
        "GPU 3 (GPU-00000003): thermal clock slowdown"
    )
    lines = [json.loads(line) for line in report_json_lines(report).splitlines()]
    assert [(line.get("check"), line["severity"]) for line in lines] == [
        ("clock_thermal", "WARNING"),
        ("row_remap", "CRITICAL"),
        (None, "CRITICAL"),
    ]
    assert lines[0]["gpu_uuid"] == "GPU-00000003" and lines[0]["value"] == "0x20"
    assert lines[-1] == {
        "summary": True,
        "host": report.host,
        "job_id": None,
        "gpus": 8,
        "severity": "CRITICAL",
        "exit_code": 2,
    }


def test_report_severity_is_the_worst_finding() -> None:
    warning = Finding("pcie_link", Severity.WARNING, "w", gpu_index=0)
    critical = Finding("xid", Severity.CRITICAL, "c", gpu_index=1)
    assert Report("h", None, 8, ()).severity == Severity.OK
    assert Report("h", None, 8, (warning,)).severity == Severity.WARNING
    assert Report("h", None, 8, (warning, critical)).severity == Severity.CRITICAL
    assert warning.key == "pcie_link:0"  # index 0 is a GPU, not the node


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "8"}, 8),
        ({"SLURM_JOB_ID": "1", "SLURM_GPUS": "h100:32", "SLURM_JOB_NUM_NODES": "4"}, 8),
        ({"SLURM_JOB_ID": "1", "SLURM_GPUS": "6", "SLURM_JOB_NUM_NODES": "4"}, None),
        ({"SLURM_JOB_ID": "1"}, None),
    ],
)
def test_expected_gpus_from_slurm(environ: dict[str, str], expected: int | None) -> None:
    assert expected_gpus_from_env(environ) == expected
