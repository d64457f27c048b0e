"""stk-health as cron runs it (real processes, a scripted GPU backend, no GPU here): exit codes, the one-line and
JSON-lines outputs, thresholds from the config file, a light import. Alerts and drains:
tests/integration/test_health_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.health_cli import ECC_ON_3, HEALTHY, gpu, health, script

THERMAL_ON_5 = [gpu(i, clock_event_reasons=0x40 if i == 5 else 0) for i in range(8)]


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


def test_never_imports_torch() -> None:
    code = (
        "import sys, stk.cli.health; print(sorted(m for m in ('torch', 'deepspeed', 'diffusers') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
