"""stk-health as cron and Slurm run it: real processes, a scripted GPU backend (no GPU here),
real apprise deliveries to a local HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.helpers import Receiver

HEALTH = [sys.executable, "-m", "stk.cli.health"]


def gpu(index: int, **readings: Any) -> dict[str, Any]:
    healthy = {
        "index": index,
        "uuid": f"GPU-{index:04d}",
        "name": "NVIDIA H100 80GB HBM3",
        "temperature": 45,
        "shutdown_temperature": 92,
        "ecc_volatile_uncorrectable": 0,
        "remap_pending": False,
        "remap_failure": False,
        "clock_event_reasons": 0,
    }
    return {**healthy, **readings}


HEALTHY = [gpu(i) for i in range(8)]
ECC_ON_3 = [gpu(i, ecc_volatile_uncorrectable=2 if i == 3 else 0) for i in range(8)]
THERMAL_ON_5 = [gpu(i, clock_event_reasons=0x40 if i == 5 else 0) for i in range(8)]


def health(args: list[str], script: Path | None, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "4242"}
    if script is not None:
        env["STK_HEALTH_SCRIPT"] = str(script)
    command = [*HEALTH, *args, "--state", str(tmp_path / "state.json")]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def script(tmp_path: Path, *runs: list[dict[str, Any]]) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(list(runs)))
    return path


def test_a_bad_option_is_unknown_not_critical(tmp_path: Path) -> None:
    proc = health(["check", "--format", "yaml"], None, tmp_path)
    assert proc.returncode == 3 and "--format" in proc.stderr


def test_no_driver_here_is_unknown_with_a_clear_line(tmp_path: Path) -> None:
    proc = health(["check", "--format", "text"], None, tmp_path)
    assert proc.returncode == 3
    assert proc.stdout.startswith("UNKNOWN: no NVIDIA driver")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("run", "code", "word"), [(HEALTHY, 0, "OK"), (THERMAL_ON_5, 1, "WARNING"), (ECC_ON_3, 2, "CRITICAL")]
)
def test_exit_code_and_one_line_per_severity(tmp_path: Path, run: list[dict[str, Any]], code: int, word: str) -> None:
    proc = health(["check", "--format", "text", "--expected-gpus", "8"], script(tmp_path, run), tmp_path)
    assert proc.returncode == code, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(word)
    if code == 2:
        assert "GPU 3" in lines[0]


def test_json_lines_end_with_a_summary(tmp_path: Path) -> None:
    proc = health(["check", "--expected-gpus", "8"], script(tmp_path, ECC_ON_3), tmp_path)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    findings, summary = rows[:-1], rows[-1]
    assert [f["check"] for f in findings] == ["ecc_uncorrectable"]
    assert findings[0]["gpu_index"] == 3 and findings[0]["severity"] == "CRITICAL"
    assert summary["summary"] is True and summary["gpus"] == 8 and summary["exit_code"] == 2
    assert summary["job_id"] == "4242"


def test_missing_gpus_are_critical(tmp_path: Path) -> None:
    proc = health(["check", "--format", "text", "--expected-gpus", "8"], script(tmp_path, HEALTHY[:7]), tmp_path)
    assert proc.returncode == 2
    assert "7" in proc.stdout and "8" in proc.stdout


def test_thresholds_from_the_config_file(tmp_path: Path) -> None:
    hot = [gpu(i, temperature=80) for i in range(8)]  # 12 degrees below shutdown
    path = script(tmp_path, hot)
    assert health(["check", "--format", "text"], path, tmp_path).returncode == 0
    config = tmp_path / "stk.toml"
    # one file for every command: its [s3] table is for the commands that talk to S3
    config.write_text(
        '[s3]\nendpoint_url = "http://127.0.0.1:9"\nretry_seconds = 30\n'
        "[health]\nexpected-gpus = 8\n[health.thresholds]\ntemperature_critical_margin = 15\n"
    )
    proc = health(["check", "--format", "text", "--config", str(config)], path, tmp_path)
    assert proc.returncode == 2 and "temperature" in proc.stdout.lower()
    config.write_text("[health.thresholds]\ntemprature_margin = 15\n")
    bad = health(["check", "--config", str(config)], path, tmp_path)
    assert bad.returncode == 3 and "temprature_margin" in bad.stderr


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


def test_never_imports_torch() -> None:
    code = (
        "import sys, stk.cli.health; print(sorted(m for m in ('torch', 'deepspeed', 'diffusers') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


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
