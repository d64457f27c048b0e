"""The sbatch templates and sbatch/pipeline.sh on a real one-node Slurm (tests/slurm_cluster.py):
the whole chain scan -> cache -> train with the tiny models on the CPU, a USR2 that checkpoints,
requeues and resumes, and a health gate that drains the node and keeps the job from training.
The templates run unchanged; only the size is overridden (1 node, 2 tasks, 2 of the 8 fake GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import free_ports, gpu, train_env
from slurm_cluster import SlurmCluster

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / "sbatch" / "pipeline.sh"
SIZE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=00:20:00"]
SETTINGS = {
    "STK_SCAN_RESOLUTION": "64", "STK_SCAN_ALIGNMENT": "64", "STK_SCAN_BATCH_SIZE": "1",
    "STK_SCAN_ALLOW_OVERSUBSCRIPTION": "1", "STK_SCAN_QUIET": "1",
    "STK_CACHE_DTYPE": "float32", "STK_CACHE_QUIET": "1",
    "STK_TRAIN_BATCH_SIZE": "1", "STK_TRAIN_PRECISION": "fp32", "STK_TRAIN_LR": "1e-3", "STK_TRAIN_MAX_STEPS": "3",
    "STK_TRAIN_QUIET": "1",
    "STK_LAUNCH_SLOTS_PER_NODE": "2",  # --exclusive hands the job all 8 fake GPUs; 2 ranks are enough here
}  # fmt: skip


@dataclass
class Run:
    root: Path  # RUN: scan/, cache/, train/
    model: str
    jobs: dict[str, str]  # stage -> job id


def submit(cluster: SlurmCluster, cwd: Path, args: list[str], **env: str) -> dict[str, str]:
    """sbatch/pipeline.sh ARGS -- SIZE from `cwd`; {stage: job id} from its output."""
    full_env = {**train_env(), **SETTINGS, **env, "SLURM_CONF": cluster.env["SLURM_CONF"]}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    proc = subprocess.run([str(PIPELINE), *args, "--", *SIZE], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(line.split() for line in proc.stdout.splitlines())


def log(cwd: Path, stage: str, job: str) -> str:
    return (cwd / "logs" / f"stk-{stage}-{job}.out").read_text()


def summaries(text: str) -> list[dict[str, Any]]:
    """The JSON summary lines a job's log holds (one per run of the job)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"output_dir"')]


def metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def pipeline(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The whole chain, submitted once: 24 generated images, a tiny SD model."""
    root = tmp_path_factory.mktemp("slurm-run")
    generate_dataset(str(root / "images"), count=24, seed=3, min_side=64, max_side=80)
    model = build_tiny_model(Family.SD, str(root / "model"))
    jobs = submit(slurm_cluster, root, [], DATA=str(root / "images"), MODEL=model, RUN=str(root))
    for job in jobs.values():
        slurm_cluster.wait(job, timeout=420)
    return Run(root, model, jobs)


def test_pipeline_runs_scan_cache_train_in_order_and_leaves_a_model(pipeline: Run, slurm_cluster: SlurmCluster):
    assert list(pipeline.jobs) == ["scan", "cache", "train"]
    info = {stage: slurm_cluster.job(job) for stage, job in pipeline.jobs.items()}
    for stage, job in info.items():
        assert job["JobState"] == "COMPLETED", f"{stage}: {job}\n{log(pipeline.root, stage, pipeline.jobs[stage])}"
    assert info["scan"]["EndTime"] <= info["cache"]["StartTime"]
    assert info["cache"]["EndTime"] <= info["train"]["StartTime"]
    assert (pipeline.root / "scan" / "metadata.parquet").exists()
    assert (pipeline.root / "cache" / "manifest.json").exists()
    (summary,) = summaries(log(pipeline.root, "train", pipeline.jobs["train"]))
    assert summary["outcome"] == "finished" and summary["steps"] == 3
    assert (pipeline.root / "train" / "final" / "model_index.json").exists()


def test_usr2_checkpoints_requeues_and_the_job_resumes_where_it_stopped(pipeline: Run, slurm_cluster: SlurmCluster):
    out = pipeline.root / "train-usr2"
    jobs = submit(slurm_cluster, pipeline.root, ["--from", "train"], MODEL=pipeline.model, RUN=str(pipeline.root),
                  OUT=str(out), STK_TRAIN_MAX_STEPS="60", STK_TRAIN_EPOCHS="100",
                  STK_TRAIN_CHECKPOINT_EVERY="0")  # fmt: skip
    job = jobs["train"]
    deadline = time.monotonic() + 240
    while len(metrics(out)) < 2:
        assert time.monotonic() < deadline, log(pipeline.root, "train", job)
        time.sleep(0.1)
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])
    deadline, hurried = time.monotonic() + 300, False
    while (info := slurm_cluster.job(job))["JobState"] != "COMPLETED":
        state = info["JobState"]
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT") and time.monotonic() < deadline, (
            f"{state}\n{log(pipeline.root, 'train', job)}"
        )
        if state == "PENDING" and int(info["Restarts"]) == 1 and not hurried:
            # Slurm holds a requeued job back for about two minutes (BeginTime); the test does not wait.
            # But slurmd revokes the old run's credential by the second: a restart within the second of
            # the requeue is killed as "Job credential revoked" (FAILED), so let that second pass.
            time.sleep(2)
            hurried = slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"]).returncode == 0
        time.sleep(0.5)
    first, second = summaries(log(pipeline.root, "train", job))
    stopped = first["steps"]
    assert first["outcome"] == "requeue" and 2 <= stopped < 60
    assert second["outcome"] == "finished" and second["steps"] == 60
    assert second["resumed_from"].endswith(f"step-{stopped:08d}")
    assert int(slurm_cluster.job(job)["Restarts"]) == 1
    assert [r["step"] for r in metrics(out)] == list(range(1, 61))


def test_health_gate_drains_a_node_with_a_critical_gpu_and_the_job_does_not_train(
    pipeline: Run, slurm_cluster: SlurmCluster, tmp_path: Path
):
    script = tmp_path / "gpus.json"
    script.write_text(json.dumps([[gpu(0), gpu(1, ecc_volatile_uncorrectable=4)]]))
    out = pipeline.root / "train-gated"
    node = slurm_cluster.node
    jobs = submit(slurm_cluster, pipeline.root, ["--from", "train"], MODEL=pipeline.model, RUN=str(pipeline.root),
                  OUT=str(out), STK_HEALTH_SCRIPT=str(script))  # fmt: skip
    job = jobs["train"]
    try:
        deadline = time.monotonic() + 120
        while True:
            info = slurm_cluster.job(job)
            if int(info.get("Restarts", 0)) >= 1 and info["JobState"] == "PENDING":
                break
            assert time.monotonic() < deadline and info["JobState"] not in ("COMPLETED", "FAILED"), info
            time.sleep(0.3)
        state = slurm_cluster.run(["scontrol", "show", "node", "-o", node]).stdout
        assert "DRAIN" in state and "Reason=stk-health: " in state and "GPU 1" in state, state
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
        text = log(pipeline.root, "train", job)
        assert "requeueing job" in text and "CRITICAL" in text
    finally:
        slurm_cluster.run(["scancel", job], check=False)
        slurm_cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        slurm_cluster.wait_idle()


def test_scan_and_cache_jobs_requeue_themselves_when_s3_stays_down(
    pipeline: Run, slurm_cluster: SlurmCluster, tmp_path: Path
):
    """S3 that answers nothing past --s3-retry-seconds is exit 69 in both commands; the templates
    requeue on it, as train.sbatch does."""
    (port,) = free_ports(1)
    down = {"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "S3_RETRY_SECONDS": "1"}
    scan_jobs = submit(slurm_cluster, tmp_path, [], DATA="s3://stk-gone/images", MODEL=pipeline.model,
                       RUN=str(tmp_path), **{f"STK_SCAN_{k}": v for k, v in down.items()})  # fmt: skip
    cache_jobs = submit(slurm_cluster, tmp_path, ["--from", "cache"], MODEL=pipeline.model, RUN=str(tmp_path),
                        SCAN=str(pipeline.root / "scan"), CACHE="s3://stk-gone/cache",
                        **{f"STK_CACHE_{k}": v for k, v in down.items()})  # fmt: skip
    waiting = {"scan": scan_jobs["scan"], "cache": cache_jobs["cache"]}
    try:
        deadline = time.monotonic() + 240
        while waiting:
            for stage, job in list(waiting.items()):
                info = slurm_cluster.job(job)
                if int(info.get("Restarts", 0)) >= 1:
                    del waiting[stage]
                    text = log(tmp_path, stage, job)
                    assert "127.0.0.1" in text and "requeueing job" in text and "exit 69" in text, text
                assert info["JobState"] not in ("COMPLETED", "FAILED"), f"{stage}: {info}\n{log(tmp_path, stage, job)}"
            assert time.monotonic() < deadline, f"not requeued: {waiting}"
            time.sleep(0.3)
    finally:
        for job in [*scan_jobs.values(), *cache_jobs.values()]:
            slurm_cluster.run(["scancel", job], check=False)
        slurm_cluster.wait_idle()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--from", "bake"], {"RUN": "/r", "MODEL": "/m"}, "--from bake: choose scan, cache or train"),
        (["--frm", "train"], {"RUN": "/r", "MODEL": "/m"}, "unknown argument --frm"),
        ([], {"MODEL": "/m"}, "set RUN to a run directory on shared storage"),
        (["--from", "train"], {"RUN": "/r"}, "set MODEL"),
        ([], {"RUN": "/r", "MODEL": "/m"}, "set DATA"),
    ],
)
def test_pipeline_refuses_bad_arguments_before_submitting_anything(args, env, message, tmp_path):
    proc = subprocess.run([str(PIPELINE), *args], capture_output=True, text=True, cwd=tmp_path, timeout=30,
                          env={"PATH": os.environ["PATH"], **env})  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert proc.stdout == "" and not (tmp_path / "logs").exists()
