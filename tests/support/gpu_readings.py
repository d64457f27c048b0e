"""Scripted GPU readings (STK_HEALTH_SCRIPT) for the Slurm pipeline and the breaker."""

from __future__ import annotations

from typing import Any


def gpu(index: int, **readings: Any) -> dict[str, Any]:
    """One GPU's readings as a STK_HEALTH_SCRIPT file lists them: a healthy H100 unless `readings` say otherwise."""
    healthy = {"temperature": 40, "shutdown_temperature": 92, "ecc_volatile_uncorrectable": 0}
    return {"index": index, "uuid": f"GPU-0000000{index}", "name": "NVIDIA H100 80GB HBM3", **healthy, **readings}
