"""stk.health.alerts delivered for real: apprise `json://` to a local HTTP server, run after run as cron would.
What to alert and when, without a server: tests/unit/health/test_alerts.py."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from support.alert_receiver import Receiver
from support.alerts import HOUR, T0, ecc, report

from stk.health.alerts import Event, notify_report, plan_events, send
from stk.health.report import Finding
from stk.health.state import AlertState

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
