"""stk.health.state: the alert state's round trip, a missing file, and a corrupt one kept aside."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from support.alerts import ecc, entry, state_of

from stk.health.report import Severity
from stk.health.state import AlertState

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
