"""stk.health.alerts: what to alert and when (pure): new, rising, lasting and cleared faults, retries of undelivered
alerts, and the title, body and payload. Real deliveries: tests/integration/test_health_alerts.py."""

from __future__ import annotations

import json
from datetime import datetime

from support.alerts import HOUR, T0, ecc, entry, report, state_of

from stk.health.alerts import apply, body, payload, plan_events, redact, title
from stk.health.report import Finding, Severity
from stk.health.state import AlertState, Entry

# --- plan_events / apply ---------------------------------------------------------------------


def test_a_new_fault_is_alerted_once() -> None:
    state = AlertState()
    events = plan_events(report(ecc()), state, T0, realert_hours=4)
    assert [(e.type, e.severity, e.finding.key) for e in events] == [
        ("gpu.fault", Severity.CRITICAL, "ecc_volatile_uncorrectable:GPU-00000003")
    ]
    apply(state, events, {events[0].id: True}, T0)
    assert state.entries[ecc().key] == entry(ecc())
    assert plan_events(report(ecc()), state, T0 + 60, realert_hours=4) == []


def test_a_rise_in_severity_is_alerted_a_fall_is_not() -> None:
    warned = state_of(entry(ecc(Severity.WARNING)))
    events = plan_events(report(ecc(Severity.CRITICAL)), warned, T0 + 60, realert_hours=4)
    assert [(e.type, e.severity) for e in events] == [("gpu.fault", Severity.CRITICAL)]
    assert plan_events(report(ecc(Severity.WARNING)), state_of(entry(ecc())), T0 + 60, realert_hours=4) == []


def test_a_lasting_fault_is_alerted_again_after_realert_hours() -> None:
    state = state_of(entry(ecc()))
    assert plan_events(report(ecc()), state, T0 + 4 * HOUR - 1, realert_hours=4) == []
    assert len(plan_events(report(ecc()), state, T0 + 4 * HOUR, realert_hours=4)) == 1
    assert plan_events(report(ecc()), state, T0 + 100 * HOUR, realert_hours=0) == []


def test_an_undelivered_alert_is_retried_and_keeps_its_first_sighting() -> None:
    state = AlertState()
    events = plan_events(report(ecc()), state, T0, realert_hours=4)
    apply(state, events, {events[0].id: False}, T0)
    assert state.entries[ecc().key] == entry(ecc(), last_alerted=None, delivered=False)
    retry = plan_events(report(ecc()), state, T0 + 60, realert_hours=4)
    assert len(retry) == 1 and retry[0].first_seen == events[0].timestamp
    apply(state, retry, {retry[0].id: True}, T0 + 60)
    assert state.entries[ecc().key] == Entry(ecc(), T0, T0 + 60, Severity.CRITICAL, True)


def test_a_cleared_fault_gives_one_recovery_retried_until_delivered() -> None:
    state = state_of(entry(ecc()), entry(ecc(gpu=5)))
    events = plan_events(report(ecc(gpu=5)), state, T0 + 60, realert_hours=4)
    assert [(e.type, e.severity, e.finding.gpu_index) for e in events] == [("gpu.recovered", Severity.OK, 3)]
    apply(state, events, {events[0].id: False}, T0 + 60)
    assert ecc().key in state.entries
    events = plan_events(report(ecc(gpu=5)), state, T0 + 120, realert_hours=4)
    apply(state, events, {events[0].id: True}, T0 + 120)
    assert list(state.entries) == [ecc(gpu=5).key]
    assert plan_events(report(ecc(gpu=5)), state, T0 + 180, realert_hours=4) == []


def test_unknown_and_ok_findings_are_not_alerted_by_default() -> None:
    no_driver = Finding("nvml", Severity.UNKNOWN, "NVML library not found")
    fine = Finding("temperature", Severity.OK, "temperature 40 C")
    assert plan_events(report(no_driver, fine), AlertState(), T0, realert_hours=4) == []
    events = plan_events(report(no_driver, fine), AlertState(), T0, realert_hours=4, alert_unknown=True)
    assert [e.finding.key for e in events] == ["nvml:node"]


def test_title_body_and_payload() -> None:
    (event,) = plan_events(report(ecc()), AlertState(), T0, realert_hours=4, rank=11)
    assert title(event) == "[CRITICAL] gpu-node-07: GPU 3 volatile uncorrectable ECC errors: 2"
    assert "job 4242, rank 11" in body(event) and "GPU-00000003" in body(event)
    data = payload(event)
    assert {k: data[k] for k in ("type", "severity", "job_id", "host", "rank")} == {
        "type": "gpu.fault",
        "severity": "critical",
        "job_id": "4242",
        "host": "gpu-node-07",
        "rank": 11,
    }
    assert data["fault"]["gpu"] == {"index": 3, "uuid": "GPU-00000003", "name": "NVIDIA H100 80GB HBM3"}
    assert datetime.fromisoformat(data["timestamp"]).timestamp() == T0
    json.dumps(data)


def test_redact_keeps_only_the_scheme() -> None:
    assert redact("to discord://123/secret and 'json://u:p@h:1/x?a=b'") == "to discord://*** and 'json://***'"
    assert redact("Max retries exceeded with url: /api/webhooks/1/tok (Caused") == (
        "Max retries exceeded with url: *** (Caused"
    )
