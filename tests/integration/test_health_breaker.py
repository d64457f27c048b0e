"""The training circuit breaker (stk.health.breaker) on scripted GPUs: the one alert of a fault, with rank, host and
job, delivered to a local HTTP server. The breaker's decisions: tests/unit/health/test_breaker.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.breaker import FAST, ecc_on, healthy, script, wait_for

from stk.health.breaker import GpuWatch
from stk.health.state import AlertState


@pytest.mark.integration
def test_the_fault_is_alerted_once_with_rank_host_and_job(
    tmp_path: Path, receiver: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    server = receiver()
    state = tmp_path / "alerts.json"
    backend = script(tmp_path, [healthy(), healthy(), ecc_on(3)])
    with GpuWatch(3, interval=FAST, backend=backend, notify_urls=[server.url()], state_path=str(state), rank=11):
        wait_for(lambda: server.bodies)
    assert server.events() == ["gpu.fault"]
    (sent,) = server.bodies
    assert {k: sent[k] for k in ("severity", "job_id", "rank")} == {
        "severity": "critical",
        "job_id": "4242",
        "rank": 11,
    }
    assert sent["host"] and sent["fault"]["gpu"]["index"] == 3
    assert AlertState.load(str(state)).entries["ecc_uncorrectable:GPU-00000003"].delivered

    # a second watch (a restarted job) on the same state does not alert the same fault again
    (tmp_path / "gpus.json.pos").unlink()
    with GpuWatch(3, interval=FAST, backend=backend, notify_urls=[server.url()], state_path=str(state)) as again:
        wait_for(lambda: again.fault is not None)
    assert server.events() == ["gpu.fault"]
