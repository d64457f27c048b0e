"""Tests for stk.health.slurm: the scontrol output parser on recorded lines, then drain and resume
against a real one-node Slurm (the slurm_cluster fixture)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster

from stk.errors import InfraError, InputError
from stk.health.report import Finding, Report, Severity
from stk.health.slurm import (
    MAX_REASON,
    NodeState,
    apply_drain_policy,
    default_node_name,
    drain,
    node_state,
    parse_node_line,
    reason_for,
    resume_if_ours,
)

# Recorded from slurm-wlm 22.05.8 (`scontrol show node -o vm`), shortened in the middle.
HEAD = "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=8 CPUTot=8 Gres=gpu:8 NodeAddr=127.0.0.1"
TAIL = (
    "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  "
    "BootTime=2026-11-21T22:41:02 SlurmdStartTime=2026-11-22T00:34:46 CfgTRES=cpu=8,mem=1M,billing=8 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)
IDLE = f"{HEAD} State=IDLE {TAIL}\n"
MAINTENANCE = f'{HEAD} State=IDLE+DRAIN {TAIL} Reason=maint "x" Foo=bar ; stuff [root@2026-11-22T00:34:46]\n'
OURS = f"{HEAD} State=MIXED+DRAIN {TAIL} Reason=stk-health: CRITICAL: GPU 3 [x]: ECC=2 [root@2026-11-22T00:35:01]"
NOT_RESPONDING = f"{HEAD} State=DOWN*+NOT_RESPONDING {TAIL} Reason=Not responding [slurm@2026-11-22T01:00:00]"


def report(severity: Severity | None, message: str = "GPU 3: volatile uncorrectable ECC errors: 2") -> Report:
    findings = () if severity is None else (Finding("ecc_volatile_uncorrectable", severity, message, gpu_index=3),)
    return Report(host="vm", job_id=None, gpus=8, findings=findings)


# --- parsing (no Slurm needed) ----------------------------------------------------------------


def test_an_idle_node_has_no_reason() -> None:
    state = parse_node_line(IDLE)
    assert state == NodeState("vm", frozenset({"IDLE"}), None)
    assert not state.drained and not state.held_by_others


def test_a_reason_keeps_quotes_and_equals_and_loses_the_user_stamp() -> None:
    state = parse_node_line(MAINTENANCE)
    assert state.states == {"IDLE", "DRAIN"}
    assert state.reason == 'maint "x" Foo=bar ; stuff'
    assert state.drained and state.held_by_others and not state.ours


def test_a_draining_node_with_our_reason_is_ours() -> None:
    state = parse_node_line(OURS)
    assert state.states == {"MIXED", "DRAIN"}
    assert state.reason == "stk-health: CRITICAL: GPU 3 [x]: ECC=2"
    assert state.drained and state.ours and not state.held_by_others


def test_a_down_node_is_held_by_someone_else() -> None:
    state = parse_node_line(NOT_RESPONDING)
    assert state.states == {"DOWN", "NOT_RESPONDING"}
    assert state.reason == "Not responding"
    assert state.held_by_others


def test_output_without_a_state_is_an_input_error() -> None:
    with pytest.raises(InputError, match="unexpected"):
        parse_node_line("Node vm not found")


def test_the_reason_is_one_line_prefixed_and_cut() -> None:
    assert reason_for("CRITICAL: a\n  b\tc") == "stk-health: CRITICAL: a b c"
    long = reason_for("x" * 1000)
    assert len(long) == MAX_REASON and long.startswith("stk-health: x") and long.endswith("...")


def test_the_node_name_is_slurmd_nodename_else_the_short_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-07")
    assert default_node_name() == "gpu-07"
    monkeypatch.delenv("SLURMD_NODENAME")
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-08.cluster.example")
    assert default_node_name() == "gpu-08"


def test_scontrol_missing_is_an_infra_error_and_failing_an_input_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InfraError, match="scontrol not found"):
        node_state("vm")
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'slurm_load_node error: Unable to contact slurm controller' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(InputError, match=r"`scontrol show node -o vm` failed: slurm_load_node error: Unable"):
        node_state("vm")


def test_warning_and_unknown_do_not_call_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: calling it would raise
    assert apply_drain_policy(report(Severity.WARNING), "vm") == "none"
    assert apply_drain_policy(report(Severity.UNKNOWN), "vm") == "none"


# --- a real Slurm -----------------------------------------------------------------------------


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """The session cluster with SLURM_CONF in this process's environment; the node idle again after."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm_cluster.env.get("PATH", os.defpath))
    yield slurm_cluster
    slurm_cluster.run(["scontrol", "update", f"NodeName={slurm_cluster.node}", "State=RESUME"], check=False)
    slurm_cluster.wait_idle()


def sinfo_reason(cluster: SlurmCluster) -> str:
    return cluster.run(["sinfo", "-h", "-N", "-n", cluster.node, "-o", "%T|%E"]).stdout.strip()


@pytest.mark.integration
def test_critical_drains_and_ok_resumes(slurm: SlurmCluster) -> None:
    node = slurm.node
    assert apply_drain_policy(report(Severity.CRITICAL), node) == "drained"
    state = node_state(node)
    assert state.drained and state.reason == "stk-health: CRITICAL: GPU 3: volatile uncorrectable ECC errors: 2"
    assert sinfo_reason(slurm).startswith("drained|stk-health: CRITICAL: GPU 3")

    assert apply_drain_policy(report(Severity.CRITICAL), node) == "none"  # same reason: no update
    assert apply_drain_policy(report(Severity.CRITICAL, "GPU 5: fell off the bus"), node) == "drained"
    assert node_state(node).reason == "stk-health: CRITICAL: GPU 5: fell off the bus"

    assert apply_drain_policy(report(Severity.WARNING), node) == "none"
    assert node_state(node).drained

    assert apply_drain_policy(report(None), node) == "resumed"
    slurm.wait_idle()  # Slurm pings a resumed node: "idle*" (not responding) for about a second
    state = node_state(node)
    assert state.states == {"IDLE"} and state.reason is None
    assert apply_drain_policy(report(None), node) == "none"  # nothing to resume


@pytest.mark.integration
def test_a_node_drained_by_someone_else_is_left_alone(slurm: SlurmCluster) -> None:
    node = slurm.node
    slurm.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=maintenance"])
    assert apply_drain_policy(report(Severity.CRITICAL), node) == "left alone: drained by someone else"
    assert apply_drain_policy(report(None), node) == "left alone: drained by someone else"
    assert not drain(node, "CRITICAL: GPU 3 gone")
    assert not resume_if_ours(node)
    state = node_state(node)
    assert state.drained and state.reason == "maintenance"
    assert sinfo_reason(slurm) == "drained|maintenance"


@pytest.mark.integration
def test_a_warning_changes_nothing(slurm: SlurmCluster) -> None:
    assert apply_drain_policy(report(Severity.WARNING), slurm.node) == "none"
    assert node_state(slurm.node) == NodeState(slurm.node, frozenset({"IDLE"}), None)
    assert not resume_if_ours(slurm.node)


@pytest.mark.integration
def test_an_unknown_node_is_an_input_error(slurm: SlurmCluster) -> None:
    with pytest.raises(InputError, match="scontrol show node -o no-such-node"):
        node_state("no-such-node")
