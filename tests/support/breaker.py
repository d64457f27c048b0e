"""Scripted GPUs for the tests of the training circuit breaker (stk.health.breaker)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stk.health.devices import ScriptedBackend
from support.gpu_readings import gpu

FAST = 0.01


def script(tmp_path: Path, runs: list[list[dict[str, Any]]]) -> ScriptedBackend:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(runs))
    return ScriptedBackend(path)


def healthy(gpus: int = 4) -> list[dict[str, Any]]:
    return [gpu(i) for i in range(gpus)]


def ecc_on(bad: int, gpus: int = 4) -> list[dict[str, Any]]:
    return [gpu(i, ecc_volatile_uncorrectable=2) if i == bad else gpu(i) for i in range(gpus)]


def wait_for(condition: Callable[[], object], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(FAST)
