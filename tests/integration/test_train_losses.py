"""stk-train refuses loss settings that mean nothing for the family before any model loads."""

from __future__ import annotations

import pytest
from support.commands import FAST, run_train

from stk.models import Family


@pytest.mark.integration
def test_stk_train_refuses_them_before_any_model_loads(setups, tmp_path):
    model, cache = setups(Family.FLUX)
    proc = run_train(
        [
            "--cache",
            cache,
            "--model",
            model,
            "--output-dir",
            tmp_path / "run",
            *FAST,
            "--snr-gamma",
            "5",
            "--max-steps",
            "1",
        ],
        mpi=0,
        timeout=120,
    )
    assert proc.returncode == 3 and "--snr-gamma and --noise-offset are for SD and SDXL" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    usage = run_train(
        ["--cache", cache, "--model", model, "--output-dir", tmp_path / "run", "--flow-shift", "x"], mpi=0
    )
    assert usage.returncode == 2 and "a positive number like 3.0, or one of example, auto" in usage.stderr
