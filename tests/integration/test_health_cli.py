"""stk-health as cron and Slurm run it, end to end: real apprise deliveries to a local HTTP server, `watch` passes,
and `check --drain` against a real one-node Slurm. Scripted GPUs (no GPU here)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.alert_receiver import Receiver
from support.health_cli import ECC_ON_3, HEALTH, HEALTHY, health, script


@pytest.mark.integration
def test_cron_hour_sends_one_alert_then_one_recovery(tmp_path: Path, receiver: Callable[..., Receiver]) -> None:
    server = receiver()
    path = script(tmp_path, *([ECC_ON_3] * 60), *([HEALTHY] * 5))
    notify = ["check", "--expected-gpus", "8", "--notify", f"json://127.0.0.1:{server.port}/hook"]
    codes = [health(notify, path, tmp_path).returncode for _ in range(65)]
    assert codes == [2] * 60 + [0] * 5
    events = server.events()
    assert events == ["gpu.fault", "gpu.recovered"]
    fault = server.bodies[0]
    assert fault["severity"] == "critical" and fault["job_id"] == "4242"
    assert fault["fault"]["gpu"] == {"index": 3, "uuid": "GPU-0003", "name": "NVIDIA H100 80GB HBM3"}
    assert fault["fault"]["check"] == "ecc_uncorrectable" and fault["fault"]["value"] == 2


@pytest.mark.integration
def test_watch_runs_a_pass_every_interval_until_stopped(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STK_HEALTH_SCRIPT": str(script(tmp_path, HEALTHY))}
    command = [*HEALTH, "watch", "--interval", "1", "--expected-gpus", "8", "--state", str(tmp_path / "s.json")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(2.6)
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    summaries = [json.loads(line) for line in out.splitlines() if '"summary"' in line]
    assert proc.returncode == 0, err
    assert len(summaries) >= 2 and all(s["severity"] == "OK" and s["gpus"] == 8 for s in summaries)


@pytest.mark.integration
def test_check_drain_takes_a_faulty_node_out_and_brings_it_back(
    slurm_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stk.health.slurm import node_state

    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    env = {**slurm_cluster.env, "HOME": str(tmp_path), "SLURMD_NODENAME": slurm_cluster.node}
    env["STK_HEALTH_SCRIPT"] = str(script(tmp_path, ECC_ON_3, HEALTHY))
    command = [*HEALTH, "check", "--drain", "--format", "text", "--expected-gpus", "8"]
    command += ["--state", str(tmp_path / "s.json")]
    try:
        assert subprocess.run(command, env=env, capture_output=True, timeout=60).returncode == 2
        drained = node_state(slurm_cluster.node)
        assert "DRAIN" in drained.states and drained.reason is not None
        assert drained.reason.startswith("stk-health: CRITICAL: GPU 3")
        assert subprocess.run(command, env=env, capture_output=True, timeout=60).returncode == 0
        assert "DRAIN" not in node_state(slurm_cluster.node).states
    finally:
        slurm_cluster.wait_idle()
