"""stk-train under the GPU circuit breaker: a scripted GPU fault stops every rank with the GPU code and one alert, and
no GPU means nothing to watch.

Real DeepSpeed engines on the CPU under `mpiexec -n 2`, tiny random-weight pipelines and caches made by stk-cache
(fixtures `scan` and `setups`)."""

from __future__ import annotations

import json

import pytest
from support.commands import FAST, run_train, summary_of
from support.gpu_readings import gpu
from support.train_outputs import metrics

from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration


def test_scripted_gpu_fault_stops_every_rank_with_the_gpu_code_and_one_alert(setups, tmp_path, receiver):
    model, cache = setups(Family.SD)
    hook = receiver()
    script = tmp_path / "gpus.json"
    healthy = [gpu(0), gpu(1)]
    script.write_text(json.dumps([healthy] * 6 + [[gpu(0), gpu(1, ecc_volatile_uncorrectable=3)]]))
    out = tmp_path / "run"
    proc = run_train(
        [
            "--cache",
            cache,
            "--model",
            model,
            "--output-dir",
            out,
            "--deepspeed",
            "zero2",
            "--epochs",
            "50",
            "--health-interval",
            "0.2",
            "--notify",
            hook.url(),
            "--lora-rank",
            "4",
            *FAST,
        ],  # a LoRA stops the same
        env={"STK_HEALTH_SCRIPT": str(script), "SLURM_JOB_ID": "4242"},
    )
    assert proc.returncode == ExitCode.GPU_FAULT, proc.stderr
    summary = summary_of(proc)
    assert summary["outcome"] == "gpu_fault" and summary["final"] is None
    assert "GPU fault" in proc.stderr
    alerts = hook.bodies
    assert [a["type"] for a in alerts] == ["gpu.fault"], alerts
    assert alerts[0]["rank"] == 1 and alerts[0]["job_id"] == "4242" and alerts[0]["fault"]["gpu"]["index"] == 1


def test_max_steps_past_one_epoch_trains_that_many_and_no_gpu_means_nothing_to_watch(setups, tmp_path):
    """One process, batch 8: an epoch of the 24 images is 3 steps; --max-steps 4 goes on into the second epoch
    (--epochs stays at its default, 1). The same run shows that no GPU leaves nothing to watch."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--max-steps", "4", *FAST[:-1], "--batch-size", 8]
    proc = run_train(args, mpi=0)
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA driver: nothing to watch" in proc.stderr
    assert summary_of(proc)["steps"] == 4
    assert [(row["step"], row["epoch"]) for row in metrics(out)] == [(1, 0.3333), (2, 0.6667), (3, 1.0), (4, 1.3333)]
