"""Drain and resume this node in Slurm from a health report, as NHC does, through `scontrol`.

stk-health only ever undoes its own drains: a node drained with a reason that does not start
with "stk-health:" (an admin's maintenance, another checker) is left exactly as it is.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from stk.cluster.slurm import scontrol
from stk.errors import InputError
from stk.health.check import report_text
from stk.health.report import Report, Severity

__all__ = [
    "REASON_PREFIX",
    "NodeState",
    "apply_drain_policy",
    "default_node_name",
    "drain",
    "node_state",
    "parse_node_line",
    "reason_for",
    "resume_if_ours",
]

REASON_PREFIX = "stk-health:"
MAX_REASON = 200  # characters, prefix included: enough for sinfo -R and scontrol, short enough to read
# Reason= is the last field and may hold anything, "=" included; Slurm appends " [user@time]".
_REASON = re.compile(r"(?:^|\s)Reason=(.*?)(?:\s+\[[^\]]*@[^\]]*\])?\s*$")
_STATE = re.compile(r"(?:^|\s)State=(\S+)")
_NAME = re.compile(r"^NodeName=(\S+)")


@dataclass(frozen=True)
class NodeState:
    """A node as `scontrol show node` reports it: state flags upper-case (IDLE, DRAIN, ...), reason as set."""

    name: str
    states: frozenset[str]
    reason: str | None

    @property
    def drained(self) -> bool:
        """Drained or draining: no new jobs start here."""
        return "DRAIN" in self.states or "DRAINED" in self.states or "DRAINING" in self.states

    @property
    def ours(self) -> bool:
        """The reason is one stk-health set."""
        return self.reason is not None and self.reason.startswith(REASON_PREFIX)

    @property
    def held_by_others(self) -> bool:
        """Drained, down or failed for a reason stk-health did not set: not ours to touch."""
        held = self.drained or bool(self.states & {"DOWN", "FAIL", "FAILING"})
        return held and not self.ours


def default_node_name() -> str:
    """SLURMD_NODENAME (set by slurmd for jobs and prologs), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def parse_node_line(line: str) -> NodeState:
    """Read one `scontrol show node -o` line (State=IDLE+DRAIN ... Reason=text [user@time])."""
    name, state = _NAME.search(line.strip()), _STATE.search(line)
    if name is None or state is None:
        raise InputError(f"unexpected `scontrol show node -o` output: {line.strip()[:200]!r}")
    reason = _REASON.search(line.strip())
    text = reason.group(1).strip() if reason else ""
    states = frozenset(s.rstrip("*~#!%$@^-") for s in state.group(1).upper().split("+") if s)
    return NodeState(name.group(1), states, text if text and text != "(null)" else None)


def reason_for(text: str) -> str:
    """The Reason= stk-health sets: the prefix, then `text` on one line, cut to MAX_REASON characters."""
    flat = " ".join(text.split())
    reason = f"{REASON_PREFIX} {flat}"
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3].rstrip() + "..."


def node_state(node: str | None = None) -> NodeState:
    """The node's state and reason, from `scontrol show node -o NODE`."""
    name = node or default_node_name()
    lines = [line for line in scontrol("show", "node", "-o", name).splitlines() if line.strip()]
    if not lines:
        raise InputError(f"`scontrol show node -o {name}` printed nothing")
    return parse_node_line(lines[0])


def _set_drain(node: str, reason: str) -> None:
    scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")


def drain(node: str | None, reason: str) -> bool:
    """Drain the node with Reason="stk-health: <reason>", unless someone else holds it; an stk-health
    drain is only rewritten when the reason changed. Returns whether scontrol was asked to act."""
    name = node or default_node_name()
    state, wanted = node_state(name), reason_for(reason)
    if state.held_by_others or (state.drained and state.reason == wanted):
        return False
    _set_drain(name, wanted)
    return True


def resume_if_ours(node: str | None = None) -> bool:
    """Resume the node only when stk-health drained it; returns whether it did."""
    name = node or default_node_name()
    state = node_state(name)
    if not (state.drained and state.ours):
        return False
    scontrol("update", f"NodeName={name}", "State=RESUME")
    return True


def apply_drain_policy(report: Report, node: str | None = None) -> str:
    """CRITICAL drains, OK resumes an stk-health drain, WARNING and UNKNOWN change nothing.
    Returns "drained", "resumed", "left alone: drained by someone else" or "none"."""
    severity = report.severity
    if severity not in (Severity.CRITICAL, Severity.OK):
        return "none"
    name = node or default_node_name()
    if node_state(name).held_by_others:
        return "left alone: drained by someone else"
    if severity is Severity.CRITICAL:
        return "drained" if drain(name, report_text(report)) else "none"
    return "resumed" if resume_if_ours(name) else "none"
