"""Where the S3 retry budget comes from: the option, the environment or the config, and stk-launch passing a given
budget on to stk-train."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import scan_command, scan_env
from support.slurm_cluster import free_ports

from stk.errors import ExitCode

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("source", ["option", "environment", "config [s3]", "config [scan]"])
def test_the_budget_comes_from_option_environment_or_config(tmp_path: Path, source: str):
    """An endpoint where nothing listens, a 2 s budget set four ways: exit 69 naming it, in bounded time."""
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    config = tmp_path / "stk.toml"
    args, env = ["s3://nowhere/images", "--out", str(tmp_path / "out"), "--s3-endpoint-url", endpoint], scan_env()
    if source == "option":
        args += ["--s3-retry-seconds", "2"]
    elif source == "environment":
        env["STK_SCAN_S3_RETRY_SECONDS"] = "2"
    else:
        table = "[s3]\nretry_seconds = 2\n" if source == "config [s3]" else "[scan]\ns3-retry-seconds = 2\n"
        config.write_text(table)
        args += ["--config", str(config)]
    started = time.monotonic()
    proc = subprocess.run(scan_command(args), capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == ExitCode.INFRA, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"S3 endpoint {endpoint} did not answer for 2 s (s3://nowhere/" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 2 + 30


@pytest.mark.parametrize("given", [True, False])
def test_stk_launch_passes_a_given_budget_on_to_stk_train(tmp_path: Path, given: bool):
    args = ["--dry-run", "--hosts", "localhost", "--slots-per-node", "2", "--hostfile", str(tmp_path / "hosts")]
    args += ["--s3-retry-seconds", "300"] if given else []
    command = [sys.executable, "-m", "stk.cli.launch", *args, "--", "--cache", "c", "--model", "m", "--output-dir", "o"]
    proc = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("export STK_TRAIN_S3_RETRY_SECONDS=300" in proc.stdout) is given, proc.stdout
