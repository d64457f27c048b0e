"""Tests for stk.health.alerts and stk.health.state: what to alert and when (pure), then real
deliveries through apprise `json://` to a local HTTP server, run after run as cron would."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from support.helpers import Receiver

from stk.health.alerts import Event, apply, body, notify_report, payload, plan_events, redact, send, title
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


# --- the state file --------------------------------------------------------------------------


def test_state_round_trip_and_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "state" / "alerts.json")
    assert AlertState.load(path).entries == {}
    state = state_of(entry(ecc()), entry(ecc(Severity.WARNING, gpu=1), last_alerted=None, delivered=False))
    state.save(path)
    assert AlertState.load(path) == state
    assert json.loads(Path(path).read_text())["alerts"][ecc().key]["message"] == ecc().message


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", b'{"version": 1, "alerts": {"k": {"first_seen": 1}}}', b'{"version": 99, "alerts": {}}'],
)
def test_a_corrupt_state_is_kept_aside_and_starts_afresh(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "alerts.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert AlertState.load(str(path)).entries == {}
    assert "corrupt" in caplog.text
    assert (tmp_path / "alerts.json.corrupt").read_bytes() == content


# --- real deliveries -------------------------------------------------------------------------


def every_minute(
    runs: int, state_path: str, urls: list[str], realert_hours: float, findings: tuple[Finding, ...], start: float = T0
) -> list[Event]:
    sent = []
    for minute in range(runs):
        sent += notify_report(report(*findings), state_path, urls, None, realert_hours, now=start + 60 * minute)
    return sent


@pytest.mark.integration
def test_an_hour_of_cron_gives_one_alert_then_one_recovery(tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    state = str(tmp_path / "alerts.json")
    every_minute(60, state, [server.url()], 4, (ecc(),))
    assert server.events() == ["gpu.fault"]
    every_minute(10, state, [server.url()], 4, (), start=T0 + HOUR)
    assert server.events() == ["gpu.fault", "gpu.recovered"]
    assert AlertState.load(state).entries == {}

    fault, recovered = server.bodies
    assert fault["path"] == "/hook"
    assert fault["type"] == "gpu.fault" and recovered["type"] == "gpu.recovered"  # as trainers' webhooks
    assert fault["notify_type"] == "failure" and recovered["notify_type"] == "success"  # apprise's own
    assert "version" not in fault
    assert {k: fault[k] for k in ("title", "severity", "job_id", "host", "rank")} == {
        "title": "[CRITICAL] gpu-node-07: GPU 3 volatile uncorrectable ECC errors: 2",
        "severity": "critical",
        "job_id": "4242",
        "host": "gpu-node-07",
        "rank": None,
    }
    assert fault["fault"] == {
        "check": "ecc_volatile_uncorrectable",
        "severity": "critical",
        "value": 2,
        "threshold": 0,
        "message": "volatile uncorrectable ECC errors: 2",
        "gpu": {"index": 3, "uuid": "GPU-00000003", "name": "NVIDIA H100 80GB HBM3"},
    }
    assert datetime.fromisoformat(fault["timestamp"]).timestamp() == T0
    assert "\n" in fault["message"]
    assert recovered["severity"] == "ok" and recovered["fault"]["gpu"]["index"] == 3
    assert recovered["title"].startswith("[RECOVERED] gpu-node-07: GPU 3")


@pytest.mark.integration
def test_realert_every_half_hour(tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    every_minute(60, str(tmp_path / "alerts.json"), [server.url()], 0.5, (ecc(),))
    assert server.events() == ["gpu.fault", "gpu.fault"]  # minutes 0 and 30
    stamps = [datetime.fromisoformat(b["timestamp"]).timestamp() for b in server.bodies]
    assert stamps == [T0, T0 + 30 * 60]
    assert {b["first_seen"] for b in server.bodies} == {server.bodies[0]["timestamp"]}


@pytest.mark.integration
def test_a_corrupt_state_file_alerts_again(tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    state = tmp_path / "alerts.json"
    every_minute(3, str(state), [server.url()], 4, (ecc(),))
    state.write_text('{"version": 1, "alerts": {"ecc')
    every_minute(3, str(state), [server.url()], 4, (ecc(),), start=T0 + 600)
    assert server.events() == ["gpu.fault", "gpu.fault"]
    assert (tmp_path / "alerts.json.corrupt").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_an_unreachable_endpoint_is_retried_next_run(
    tmp_path: Path, receiver: Callable[..., Receiver], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    url = f"json://stk:hunter2secret@127.0.0.1:{port}/hook"
    state = str(tmp_path / "alerts.json")
    caplog.set_level(logging.DEBUG)
    events = notify_report(report(ecc()), state, [url, "http://not-apprise.example/token"], None, 4, now=T0)
    assert [e.type for e in events] == ["gpu.fault"]
    assert AlertState.load(state).entries[ecc().key].delivered is False
    assert "not delivered" in caplog.text and "json://***" in caplog.text

    server = receiver(port)
    notify_report(report(ecc()), state, [url], None, 4, now=T0 + 60)
    notify_report(report(ecc()), state, [url], None, 4, now=T0 + 120)
    assert server.events() == ["gpu.fault"]
    sent = server.bodies[0]
    assert [datetime.fromisoformat(sent[k]).timestamp() for k in ("first_seen", "timestamp")] == [T0, T0 + 60]
    saved = AlertState.load(state).entries[ecc().key]
    assert (saved.delivered, saved.first_seen, saved.last_alerted) == (True, T0, T0 + 60)
    for secret in (url, "hunter2secret", "not-apprise.example", f"127.0.0.1:{port}/hook"):
        assert secret not in caplog.text


@pytest.mark.integration
def test_send_counts_an_event_delivered_when_one_target_took_it(receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    (event,) = plan_events(report(ecc()), AlertState(), T0, realert_hours=4)
    closed = f"json://127.0.0.1:{free_port()}/hook"
    assert send([event], [closed, server.url("/a")]) == {event.id: True}
    assert send([event], [closed]) == {event.id: False}
    assert send([event], []) == {event.id: False}
    assert [b["path"] for b in server.bodies] == ["/a"]


@pytest.mark.integration
def test_targets_from_an_apprise_config_file(tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    config = tmp_path / "apprise.yml"
    config.write_text(f"urls:\n  - {server.url('/from-config')}\n")
    (event,) = plan_events(report(ecc()), AlertState(), T0, realert_hours=4)
    assert send([event], [], str(config)) == {event.id: True}
    assert [b["path"] for b in server.bodies] == ["/from-config"]
