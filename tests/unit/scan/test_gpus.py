"""stk.scan.gpus: the --gpus default, from the option, then Slurm, then NVML, then 1."""

from __future__ import annotations

import json
import os

from stk.health.devices import SCRIPT_ENV
from stk.scan.gpus import training_gpus

# --- the GPU count of the batch check ------------------------------------------------------------


def test_gpus_come_from_the_option_then_slurm_then_nvml_then_1(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("SLURM_")] + [SCRIPT_ENV]:
        monkeypatch.delenv(name, raising=False)
    assert training_gpus(None) == (1, "default")  # no Slurm, no NVIDIA driver here
    script = tmp_path / "gpus.json"
    script.write_text(json.dumps([[{"index": i, "uuid": f"GPU-{i}", "name": "H100"} for i in range(4)]]))
    monkeypatch.setenv(SCRIPT_ENV, str(script))
    assert training_gpus(None) == (4, "nvml")
    assert training_gpus(None) == (4, "nvml")  # counting does not move the script on
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS", "h100:32")
    assert training_gpus(None) == (32, "slurm")
    assert training_gpus(3) == (3, "option")
