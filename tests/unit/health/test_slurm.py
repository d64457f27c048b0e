"""stk.health.slurm: the scontrol output parser on recorded lines and what it decides from them. Drain and resume
against a real Slurm: tests/integration/test_health_slurm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.scontrol import HEAD, IDLE, TAIL, report

from stk.errors import InfraError, InputError
from stk.health.report import Severity
from stk.health.slurm import (
    MAX_REASON,
    NodeState,
    apply_drain_policy,
    default_node_name,
    node_state,
    parse_node_line,
    reason_for,
)

MAINTENANCE = f'{HEAD} State=IDLE+DRAIN {TAIL} Reason=maint "x" Foo=bar ; stuff [root@2026-11-22T00:34:46]\n'
OURS = f"{HEAD} State=MIXED+DRAIN {TAIL} Reason=stk-health: CRITICAL: GPU 3 [x]: ECC=2 [root@2026-11-22T00:35:01]"
NOT_RESPONDING = f"{HEAD} State=DOWN*+NOT_RESPONDING {TAIL} Reason=Not responding [slurm@2026-11-22T01:00:00]"


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
