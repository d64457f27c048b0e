"""stk-health run as cron and Slurm run it, on scripted GPUs (STK_HEALTH_SCRIPT)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
