"""GPU fault alerts through apprise: on change and every few hours while a fault lasts, never
every minute from cron.

`plan_events` decides from a report and the alert state what to send (pure); `send` delivers
through apprise; `apply` records the outcome; `notify_report` does all of it for one run. An
alert that could not be delivered is sent again on the next run.

`json://` and `jsons://` endpoints receive the fields that trainers' gpu.fault webhooks send
(`type` = "gpu.fault" or "gpu.recovered", `severity`, `job_id`, `host`, `rank`, `title`, `message`,
`timestamp`, `fault`, ...), so existing receivers keep working, through apprise's own payload extras
(what `:key=value` in the URL does); apprise's notification type is kept as `notify_type`.
Every other service gets the title and the multi-line body.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Literal

import apprise
from apprise.plugins.custom_json import NotifyJSON

from stk.health.report import Finding, Report, Severity
from stk.health.state import AlertState, Entry, locked
from stk.log import get_logger

__all__ = ["Event", "apply", "body", "notify_report", "payload", "plan_events", "redact", "send", "title"]

log = get_logger("health.alerts")

EventType = Literal["gpu.fault", "gpu.recovered"]

_NOTIFY_TYPE = {
    Severity.OK: apprise.NotifyType.SUCCESS,
    Severity.WARNING: apprise.NotifyType.WARNING,
    Severity.CRITICAL: apprise.NotifyType.FAILURE,
    Severity.UNKNOWN: apprise.NotifyType.WARNING,
}


@dataclass(frozen=True)
class Event:
    """One alert to send. `severity` is OK for a recovery; `finding` is the fault it is about."""

    type: EventType
    severity: Severity
    finding: Finding
    host: str
    job_id: str | None
    timestamp: str  # ISO 8601, UTC
    rank: int | None = None  # set when the check runs inside training
    first_seen: str | None = None  # ISO 8601, UTC: when the fault was first seen

    @property
    def id(self) -> str:
        """Unique within one plan: one event per finding key."""
        return f"{self.type}:{self.finding.key}"


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def _alertable(finding: Finding, alert_unknown: bool) -> bool:
    if finding.severity == Severity.UNKNOWN:
        return alert_unknown
    return finding.severity != Severity.OK


def plan_events(
    report: Report,
    state: AlertState,
    now: float,
    realert_hours: float,
    rank: int | None = None,
    alert_unknown: bool = False,
) -> list[Event]:
    """The alerts this run owes. A fault is alerted when it is new, when its severity rose above
    the last alert's, when the last delivered alert is `realert_hours` old (0 or less: never
    again), or when the last try was not delivered. A fault in the state and no longer in the
    report gives a recovery. UNKNOWN findings (no driver, no answer) count only with `alert_unknown`."""
    current = {f.key: f for f in report.findings if _alertable(f, alert_unknown)}
    stamp = _iso(now)
    events = []
    for key, finding in current.items():
        entry = state.entries.get(key)
        if entry is not None and not _due(entry, finding, now, realert_hours):
            continue
        first_seen = _iso(entry.first_seen if entry is not None else now)
        events.append(
            Event("gpu.fault", finding.severity, finding, report.host, report.job_id, stamp, rank, first_seen)
        )
    for key, entry in state.entries.items():
        if key not in current:
            first_seen = _iso(entry.first_seen)
            events.append(
                Event("gpu.recovered", Severity.OK, entry.finding, report.host, report.job_id, stamp, rank, first_seen)
            )
    return events


def _due(entry: Entry, finding: Finding, now: float, realert_hours: float) -> bool:
    if not entry.delivered or finding.severity > entry.severity:
        return True
    return realert_hours > 0 and entry.last_alerted is not None and now - entry.last_alerted >= realert_hours * 3600


def apply(state: AlertState, events: list[Event], delivered: dict[str, bool], now: float) -> None:
    """Record what was sent: a fault's entry keeps its first sighting and the time of the last
    delivered alert; a delivered recovery removes the entry, an undelivered one is retried."""
    for event in events:
        ok = delivered.get(event.id, False)
        key = event.finding.key
        entry = state.entries.get(key)
        if event.type == "gpu.recovered":
            if ok:
                state.entries.pop(key, None)
            continue
        if entry is None:
            entry = Entry(event.finding, now, None, event.severity, False)
        state.entries[key] = replace(
            entry,
            finding=event.finding,
            severity=event.severity,
            delivered=ok,
            last_alerted=now if ok else entry.last_alerted,
        )


# --- what an alert says --------------------------------------------------------------------


def _where(finding: Finding) -> str:
    return "node" if finding.gpu_index is None else f"GPU {finding.gpu_index}"


def title(event: Event) -> str:
    """One line, e.g. "[CRITICAL] gpu-node-07: GPU 3 volatile uncorrectable ECC 2 > 0"."""
    label = "RECOVERED" if event.type == "gpu.recovered" else event.severity.name
    message = event.finding.message
    if event.finding.gpu_index is not None and not message.startswith(_where(event.finding)):
        message = f"{_where(event.finding)} {message}"
    return f"[{label}] {event.host}: {message}"


def body(event: Event) -> str:
    """Several short lines for people (Discord, Slack, mail)."""
    f = event.finding
    first = "cleared" if event.type == "gpu.recovered" else event.severity.name.lower()
    lines = [f"{first}: {f.message}", f"host {event.host}"]
    if event.job_id is not None:
        lines[-1] += f", job {event.job_id}"
    if event.rank is not None:
        lines[-1] += f", rank {event.rank}"
    if f.gpu_index is not None:
        lines.append(f"GPU {f.gpu_index}: {f.gpu_name or '?'} ({f.gpu_uuid or 'no UUID'})")
    lines.append(f"check {f.check}: value {f.value!r}, threshold {f.threshold!r}")
    if event.first_seen is not None:
        lines.append(f"first seen {event.first_seen}")
    lines.append(f"at {event.timestamp}")
    return "\n".join(lines)


def payload(event: Event) -> dict[str, Any]:
    """The structured alert, with the fields trainers' gpu.fault webhooks send."""
    f = event.finding
    return {
        "type": event.type,
        "severity": event.severity.name.lower(),
        "job_id": event.job_id,
        "host": event.host,
        "rank": event.rank,
        "title": title(event),
        "message": body(event),
        "timestamp": event.timestamp,
        "first_seen": event.first_seen,
        "fault": {
            "check": f.check,
            "severity": f.severity.name.lower(),
            "value": f.value,
            "threshold": f.threshold,
            "message": f.message,
            "gpu": {"index": f.gpu_index, "uuid": f.gpu_uuid, "name": f.gpu_name},
        },
    }


# --- delivery --------------------------------------------------------------------------------

_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://[^\s'\"]+")
_PATH = re.compile(r"\b(url: )[^\s'\"]+")  # in requests' errors: "Max retries exceeded with url: /api/..."


def redact(text: str) -> str:
    """Every URL in `text` reduced to its scheme ("json://***"), and request paths hidden."""
    return _PATH.sub(r"\1***", _URL.sub(r"\1://***", text))


class _Redact(logging.Filter):
    """Removes URLs from apprise's log records (it logs an unparseable URL whole)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


@contextlib.contextmanager
def _redacted_apprise_logs() -> Iterator[None]:
    logger = logging.getLogger("apprise")
    guard = _Redact()
    logger.addFilter(guard)
    try:
        yield
    finally:
        logger.removeFilter(guard)


def _targets(urls: list[str], config_path: str | None) -> list[Any]:
    """The apprise plugins for `urls` and the URLs in the apprise config file; unusable ones are
    logged by scheme only and skipped."""
    bundle = apprise.Apprise()
    for url in urls:
        if not bundle.add(url):
            log.warning("alert URL %s is not one apprise can use: skipped", redact(url) if "://" in url else "***")
    if config_path is not None:
        config = apprise.AppriseConfig()
        if not config.add(config_path):
            log.warning("apprise config %s cannot be used: skipped", redact(config_path))
        bundle.add(config)
    return list(bundle.find())


def _scheme(target: Any) -> str:
    url = str(target.url(privacy=True))
    return redact(url) if "://" in url else "***"


def send(events: list[Event], urls: list[str], config_path: str | None = None) -> dict[str, bool]:
    """Deliver each event to every target; {event id: delivered}. An event counts as delivered
    when at least one target took it (a target that is down does not make the others get it
    again every minute). Never raises for an endpoint that fails; URLs are never logged."""
    if not events:
        return {}
    with _redacted_apprise_logs():
        targets = _targets(urls, config_path)
        if not targets:
            log.warning("no alert target configured: %d alert(s) kept for the next run", len(events))
        result = {}
        for event in events:
            result[event.id] = any([_deliver(target, event) for target in targets])
    return result


def _deliver(target: Any, event: Event) -> bool:
    extras = version = None
    if isinstance(target, NotifyJSON):
        extras, version = target.payload_extras, target.json_version
        fields = payload(event)
        del fields["title"], fields["message"], fields["type"]  # apprise sends title and message itself
        # Receivers of trainers' webhooks branch on "type": "gpu.fault", but apprise fills "type" with
        # its own notification type. Its payload extras rename keys in order: apprise's "type" becomes
        # "notify_type", then "version" (carrying the event type for this one call) becomes "type".
        target.json_version = event.type
        target.payload_extras = {**extras, "type": "notify_type", "version": "type", **fields}
    try:
        ok = bool(target.notify(body=body(event), title=title(event), notify_type=_NOTIFY_TYPE[event.severity]))
    except Exception as exc:  # a plugin bug must not stop the health check
        log.warning("alert to %s raised %s", _scheme(target), type(exc).__name__)
        ok = False
    finally:
        if extras is not None:
            target.payload_extras, target.json_version = extras, version
    if not ok:
        log.warning("alert %s to %s not delivered: retried on the next run", event.id, _scheme(target))
    return ok


def notify_report(
    report: Report,
    state_path: str,
    urls: list[str],
    config_path: str | None,
    realert_hours: float,
    now: float | None = None,
    rank: int | None = None,
    alert_unknown: bool = False,
) -> list[Event]:
    """One run: load the state, plan, send, record, save. Returns the events it tried to send;
    whether each got through is in the state (undelivered ones go again next run)."""
    now = time.time() if now is None else now
    with locked(state_path):
        state = AlertState.load(state_path)
        events = plan_events(report, state, now, realert_hours, rank=rank, alert_unknown=alert_unknown)
        delivered = send(events, urls, config_path)
        apply(state, events, delivered, now)
        state.save(state_path)
    for event in events:
        if delivered.get(event.id):
            log.info("alert sent: %s", title(event))
    return events
