"""stk.health.slurm against a real one-node Slurm (the slurm_cluster fixture): drain and resume."""

from __future__ import annotations

import pytest
from support.scontrol import report
from support.slurm_cluster import SlurmCluster

from stk.errors import InputError
from stk.health.report import Severity
from stk.health.slurm import (
    NodeState,
    apply_drain_policy,
    drain,
    node_state,
    resume_if_ours,
)

# --- a real Slurm -----------------------------------------------------------------------------


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
