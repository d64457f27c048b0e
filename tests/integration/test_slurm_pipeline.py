"""The sbatch templates and sbatch/pipeline.sh across four real Slurm nodes (tests/support/slurm_nodes.py: four
namespaces on a bridge, a slurmd each, a private /tmp each): the whole chain scan -> cache -> train with
the tiny models on the CPU over 4 nodes x 2 tasks, a USR2 that checkpoints every rank on every node,
requeues and resumes, a GPU fault that drains only its own node, a node whose processes die, and a
node that does not share the output directory. The templates run unchanged; only the size is
overridden by sbatch options."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.alert_receiver import Receiver
from support.commands import REPO, train_env
from support.gpu_readings import gpu
from support.slurm_cluster import free_ports
from support.slurm_nodes import SlurmNodes
from support.weed_server import S3_ENV, WeedServer, s3_client, upload_cache

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model

pytestmark = pytest.mark.integration

PIPELINE = REPO / "sbatch" / "pipeline.sh"
NODES = ["node1", "node2", "node3", "node4"]
SIZE = ["--nodes=4", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=00:20:00"]
RANKS_PER_NODE = 2
FOUR_NODES_ONE_RANK = ["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=00:20:00"]
ONE_RANK = {"STK_LAUNCH_SLOTS_PER_NODE": "1"}  # --exclusive hands a job both GPUs of each node
THREE_NODES = ["--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=00:20:00"]
SETTINGS = {
    "STK_SCAN_RESOLUTION": "64",
    "STK_SCAN_ALIGNMENT": "64",
    "STK_SCAN_BATCH_SIZE": "1",
    "STK_SCAN_ALLOW_OVERSUBSCRIPTION": "1",
    "STK_SCAN_QUIET": "1",
    "STK_CACHE_DTYPE": "float32",
    "STK_CACHE_QUIET": "1",
    "STK_TRAIN_BATCH_SIZE": "1",
    "STK_TRAIN_PRECISION": "fp32",
    "STK_TRAIN_LR": "1e-3",
    "STK_TRAIN_MAX_STEPS": "3",
    "STK_TRAIN_QUIET": "1",
    "STK_LAUNCH_NCCL_SOCKET_IFNAME": "eth0",
    "STK_LAUNCH_GLOO_SOCKET_IFNAME": "eth0",  # each node's one interface
}
GPUS = "/tmp/stk-gpus.json"  # STK_HEALTH_SCRIPT: each node's own file, in its private /tmp
HEALTH_STATE = "/tmp/stk-health-state.json"  # what a node alerted, on that node
LOCAL_SHARDS = "/tmp/stk-test-shards"  # --local-cache-dir: each node's own


@dataclass
class Run:
    root: Path  # RUN: scan/, cache/, train/ (in the directory every node shares)
    model: str
    jobs: dict[str, str]  # stage -> job id


def submit(cluster: SlurmNodes, cwd: Path, args: list[str], size: list[str] = SIZE, **env: str) -> dict[str, str]:
    """sbatch/pipeline.sh ARGS -- SIZE from `cwd`; {stage: job id} from its output."""
    full_env = {**train_env(), **SETTINGS, **env, "SLURM_CONF": cluster.env["SLURM_CONF"]}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    proc = subprocess.run(
        [str(PIPELINE), *args, "--", *size], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split() for line in proc.stdout.splitlines())


def log(cwd: Path, stage: str, job: str) -> str:
    path = cwd / "logs" / f"stk-{stage}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


def summaries(text: str) -> list[dict[str, Any]]:
    """The JSON summary lines a job's log holds (one per run of the job)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"output_dir"')]


def metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(what: str, ready: Any, timeout: float, context: Any = "") -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s:\n{context() if callable(context) else ''}"
        time.sleep(0.2)


def submit_training(cluster: SlurmNodes, run: Run, out: Path, size: list[str], **env: str) -> dict[str, str]:
    """The pipeline from its train stage, on the run's model, scan and cache, into `out`."""
    return submit(cluster, run.root, ["--from", "train"], size, MODEL=run.model, RUN=str(run.root), OUT=str(out), **env)


def wait_checkpointed(run: Run, out: Path, job: str) -> None:
    """Until the train job's first checkpoint is in `out`."""
    wait_for(
        "checkpointed", lambda: (out / "checkpoints" / "latest").exists(), 240, lambda: log(run.root, "train", job)
    )


def hurry_requeued(cluster: SlurmNodes, job: str, restarts: int) -> bool:
    """Start a requeued job now: Slurm holds it back about two minutes (BeginTime). slurmd revokes
    the old run's credential by the second, so a restart within that second would be killed as "Job
    credential revoked": let it pass first. True once hurried."""
    info = cluster.job(job)
    if info["JobState"] != "PENDING" or int(info.get("Restarts", 0)) != restarts:
        return False
    time.sleep(2)
    return cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False).returncode == 0


def finish_requeued(cluster: SlurmNodes, root: Path, job: str, timeout: float = 300) -> None:
    """Wait until the train job, requeued once, is COMPLETED, starting its requeued run at once."""
    deadline, hurried = time.monotonic() + timeout, False
    while (info := cluster.job(job))["JobState"] != "COMPLETED":
        assert info["JobState"] not in ("FAILED", "CANCELLED", "TIMEOUT") and time.monotonic() < deadline, (
            f"{info['JobState']}\n{log(root, 'train', job)}"
        )
        hurried = hurried or hurry_requeued(cluster, job, restarts=1)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pipeline(slurm_nodes: SlurmNodes) -> Run:
    """The whole chain, submitted once: 24 generated images, a tiny SD model."""
    root = slurm_nodes.shared / "run"
    generate_dataset(str(root / "images"), count=24, seed=3, min_side=64, max_side=80)
    model = build_tiny_model(Family.SD, str(root / "model"))
    jobs = submit(slurm_nodes, root, [], DATA=str(root / "images"), MODEL=model, RUN=str(root))
    for job in jobs.values():
        slurm_nodes.wait(job, timeout=420)
    return Run(root, model, jobs)


@pytest.fixture
def healthy_gpus(slurm_nodes: SlurmNodes) -> Iterator[dict[str, Path]]:
    """Every node's STK_HEALTH_SCRIPT (two healthy GPUs) and health state, in its own /tmp; {node: script}."""
    scripts = {node: slurm_nodes.node_tmp(node) / Path(GPUS).name for node in NODES}
    for script in scripts.values():
        script.write_text(json.dumps([[gpu(0), gpu(1)]]))
    yield scripts
    for node in NODES:
        for path in slurm_nodes.node_tmp(node).glob("stk-*.json*"):  # the scripts, their .pos, the health state
            path.unlink()
        slurm_nodes.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)


def test_pipeline_runs_scan_cache_train_in_order_across_four_nodes(pipeline: Run, slurm_nodes: SlurmNodes):
    assert list(pipeline.jobs) == ["scan", "cache", "train"]
    info = {stage: slurm_nodes.job(job) for stage, job in pipeline.jobs.items()}
    for stage, job in info.items():
        assert job["JobState"] == "COMPLETED", f"{stage}: {job}\n{log(pipeline.root, stage, pipeline.jobs[stage])}"
        assert job["NodeList"] == "node[1-4]", job
    assert info["scan"]["EndTime"] <= info["cache"]["StartTime"]
    assert info["cache"]["EndTime"] <= info["train"]["StartTime"]
    assert (pipeline.root / "scan" / "metadata.parquet").exists()
    assert (pipeline.root / "cache" / "manifest.json").exists()
    train_log = log(pipeline.root, "train", pipeline.jobs["train"])
    (summary,) = summaries(train_log)
    assert summary["outcome"] == "finished" and summary["steps"] == 3
    assert summary["ranks"] == 8 and summary["hosts"] == dict.fromkeys(NODES, RANKS_PER_NODE), summary
    assert (pipeline.root / "train" / "final" / "model_index.json").exists()
    # stk-launch on node1: the hostfile over the four hosts (in node1's own /tmp), rank 0's host for the rendezvous
    hostfile = slurm_nodes.node_tmp("node1") / f"stk-hostfile-{pipeline.jobs['train']}"
    assert hostfile.read_text() == "".join(f"{node} slots={RANKS_PER_NODE}\n" for node in NODES)
    assert "4 host(s) x 2 rank(s) via deepspeed, rendezvous node1:" in train_log, train_log


def test_usr2_checkpoints_every_node_at_one_step_requeues_and_resumes(pipeline: Run, slurm_nodes: SlurmNodes):
    """The batch shell on node1 gets USR2 (as from --signal=B:USR2@180 or preemption) and passes it to
    stk-launch, which asks node1's rank; the ranks agree on the step to stop at, so every node
    checkpoints the same step."""
    out = pipeline.root / "train-usr2"
    jobs = submit_training(
        slurm_nodes,
        pipeline,
        out,
        FOUR_NODES_ONE_RANK,
        STK_TRAIN_MAX_STEPS="30",
        STK_TRAIN_EPOCHS="100",
        STK_TRAIN_CHECKPOINT_EVERY="0",
        **ONE_RANK,
    )
    job = jobs["train"]
    try:
        wait_for("training", lambda: len(metrics(out)) >= 2, 240, lambda: log(pipeline.root, "train", job))
        slurm_nodes.run(["scancel", "--signal=USR2", "--batch", job])
        finish_requeued(slurm_nodes, pipeline.root, job)
    finally:
        slurm_nodes.run(["scancel", job], check=False)
        slurm_nodes.wait(job)
    text = log(pipeline.root, "train", job)
    first, second = summaries(text)
    stopped = first["steps"]
    assert first["outcome"] == "requeue" and 2 <= stopped < 30 and first["final"] is None
    assert text.count("SIGUSR2 received: checkpointing") == 1, text[-4000:]  # by the rank stk-launch asked, once
    assert second["outcome"] == "finished" and second["steps"] == 30
    assert second["resumed_from"].endswith(f"step-{stopped:08d}")
    assert first["hosts"] == second["hosts"] == dict.fromkeys(NODES, 1)
    assert int(slurm_nodes.job(job)["Restarts"]) == 1
    assert [r["step"] for r in metrics(out)] == list(range(1, 31))  # each step once


def test_a_gpu_fault_on_node3_drains_node3_alone_alerts_once_and_the_job_requeues_onto_the_spare(
    pipeline: Run, slurm_nodes: SlurmNodes, healthy_gpus: dict[str, Path]
):
    """A three-node job lands on node1-3; its health gate runs stk-health on each, and only node3's
    GPU 1 reports an uncorrectable ECC error. node3 drains itself, one alert names it, and the
    requeued job starts on node1, node2 and node4."""
    healthy_gpus["node3"].write_text(json.dumps([[gpu(0), gpu(1, ecc_volatile_uncorrectable=4)]]))
    receiver = Receiver(host=slurm_nodes.host_address)
    out = pipeline.root / "train-gated"
    jobs = submit_training(
        slurm_nodes,
        pipeline,
        out,
        THREE_NODES,
        STK_HEALTH_SCRIPT=GPUS,
        STK_HEALTH_ARGS=f"--state {HEALTH_STATE} --notify {receiver.url()}",
        **ONE_RANK,
    )
    job = jobs["train"]
    try:
        hurried = False

        def restarted() -> bool:
            nonlocal hurried
            hurried = hurried or hurry_requeued(slurm_nodes, job, restarts=1)
            return "restart 1" in log(pipeline.root, "train", job)

        wait_for("requeued", restarted, 180, lambda: log(pipeline.root, "train", job))
        text = log(pipeline.root, "train", job)
        assert f"stk: job {job} on node[1-3], restart 0" in text and f"stk: job {job} on node[1-2,4], restart 1" in text
        node3 = slurm_nodes.run(["scontrol", "show", "node", "-o", "node3"]).stdout
        assert "DRAIN" in node3 and "Reason=stk-health: " in node3 and "GPU 1" in node3, node3
        assert [n for n in NODES if "DRAIN" in slurm_nodes.run(["scontrol", "show", "node", "-o", n]).stdout] == [
            "node3"
        ]
        assert "requeueing job" in text and "CRITICAL" in text
        assert len(receiver.bodies) == 1 and "node3" in json.dumps(receiver.bodies[0]), receiver.bodies
        assert not (out / "checkpoints").exists()  # the first run trained nothing
    finally:
        receiver.close()
        slurm_nodes.run(["scancel", job], check=False)
        slurm_nodes.wait(job)


def test_a_gpu_fault_mid_training_on_node2_stops_every_rank_at_one_step_and_the_job_resumes_without_node2(
    pipeline: Run, slurm_nodes: SlurmNodes, healthy_gpus: dict[str, Path]
):
    """node2's GPU fails after the first checkpoint: its rank alerts, every rank stops at the same
    step with exit 76, the health gate that follows drains node2, and the requeued job resumes on
    node1, node3 and node4."""
    receiver = Receiver(host=slurm_nodes.host_address)
    out = pipeline.root / "train-gpu-fault"
    jobs = submit_training(
        slurm_nodes,
        pipeline,
        out,
        THREE_NODES,
        STK_TRAIN_MAX_STEPS="10",
        STK_TRAIN_EPOCHS="100",
        STK_TRAIN_CHECKPOINT_EVERY="2",
        STK_TRAIN_HEALTH_INTERVAL="0.2",
        STK_TRAIN_NOTIFY_URLS=receiver.url(),
        STK_HEALTH_SCRIPT=GPUS,
        STK_HEALTH_ARGS=f"--state {HEALTH_STATE}",
        **ONE_RANK,
    )
    job = jobs["train"]
    try:
        wait_checkpointed(pipeline, out, job)
        healthy_gpus["node2"].write_text(json.dumps([[gpu(0, ecc_volatile_uncorrectable=4), gpu(1)]]))
        finish_requeued(slurm_nodes, pipeline.root, job)
    finally:
        receiver.close()
        slurm_nodes.run(["scancel", job], check=False)
        slurm_nodes.wait(job)
    text = log(pipeline.root, "train", job)
    faulted, finished = summaries(text)
    assert faulted["outcome"] == "gpu_fault" and faulted["steps"] < 10, faulted
    assert finished["outcome"] == "finished" and finished["steps"] == 10 and finished["resumed_from"], finished
    assert set(finished["hosts"]) == {"node1", "node3", "node4"}, finished
    assert f"stk: job {job} on node[1,3-4], restart 1" in text, text
    node2 = slurm_nodes.run(["scontrol", "show", "node", "-o", "node2"]).stdout
    assert "DRAIN" in node2 and "Reason=stk-health: " in node2, node2
    faults = [b for b in receiver.bodies if b["type"] == "gpu.fault"]
    assert faults and all("node2" in json.dumps(b) for b in faults), receiver.bodies
    assert [r["step"] for r in metrics(out)] == list(range(1, 11))  # each step once


def test_a_node_whose_ranks_die_ends_the_job_in_bounded_time_and_the_requeued_job_resumes(
    pipeline: Run, slurm_nodes: SlurmNodes
):
    """kill -9 every stk process on node4 mid-training, as when the node dies: the other ranks must
    not hang. The run ends within --collective-timeout (15 s here) naming the lost host, the job
    requeues itself (exit 69) and the rerun resumes from the last checkpoint."""
    out = pipeline.root / "train-node-lost"
    jobs = submit_training(
        slurm_nodes,
        pipeline,
        out,
        FOUR_NODES_ONE_RANK,
        STK_TRAIN_MAX_STEPS="10",
        STK_TRAIN_EPOCHS="100",
        STK_TRAIN_CHECKPOINT_EVERY="2",
        STK_TRAIN_COLLECTIVE_TIMEOUT="15",
        **ONE_RANK,
    )
    job = jobs["train"]
    try:
        wait_checkpointed(pipeline, out, job)
        processes = slurm_nodes.node_pids("node4", "stk/cli/rank.py")  # the rank and DeepSpeed's helper above it
        assert processes, log(pipeline.root, "train", job)
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(
            "ended",
            lambda: int(slurm_nodes.job(job).get("Restarts", 0)) >= 1,
            120,
            lambda: log(pipeline.root, "train", job),
        )
        ended_after = time.monotonic() - killed
        finish_requeued(slurm_nodes, pipeline.root, job)
    finally:
        slurm_nodes.run(["scancel", job], check=False)
        slurm_nodes.wait(job)
    text = log(pipeline.root, "train", job)
    print(f"the run ended {ended_after:.1f} s after node4's rank was killed")  # the Slurm page quotes it (-rP)
    assert ended_after < 15 + 30, f"{ended_after:.0f} s:\n{text}"
    lost = text.split("requeueing job")[0]
    assert "exit 69" in lost and "node4" in lost, text
    (summary,) = summaries(text)  # the killed run wrote none
    assert summary["outcome"] == "finished" and summary["steps"] == 10 and summary["resumed_from"], summary
    assert [r["step"] for r in metrics(out)] == list(range(1, 11))  # each step once, the lost run's tail replaced


def test_output_dir_not_shared_by_node4_fails_before_any_model_loads_naming_node4(
    pipeline: Run, slurm_nodes: SlurmNodes
):
    out = pipeline.root / "train-unshared"
    private = slurm_nodes.shared / "node4-private"
    for path in (out, private):
        path.mkdir()
    slurm_nodes.node_exec("node4", ["mount", "--bind", str(private), str(out)])
    try:
        jobs = submit_training(
            slurm_nodes,
            pipeline,
            out,
            FOUR_NODES_ONE_RANK,
            **ONE_RANK,
        )
        slurm_nodes.wait(jobs["train"], timeout=180)
    finally:
        slurm_nodes.node_exec("node4", ["umount", str(out)])
    info = slurm_nodes.job(jobs["train"])
    text = log(pipeline.root, "train", jobs["train"])
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "7:0", f"{info}\n{text}"
    assert "is not one directory shared by every rank" in text, text
    assert "node1, node2, node3, rank(s) 0-2: see the files of rank(s) 0-2 only" in text, text
    assert "node4, rank(s) 3: see the files of rank(s) 3 only" in text, text
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_each_node_keeps_its_own_copy_of_the_s3_shards_in_its_local_dir(pipeline: Run, slurm_nodes: SlurmNodes):
    """The cache on S3 (a server on the bridge, which every node reaches) and --local-cache-dir in
    each node's private /tmp: every node holds one whole copy of each shard its rank read (no
    temp files left), and the run finishes on the shared output directory."""
    server = WeedServer(slurm_nodes.shared / "weed", ip=slurm_nodes.host_address)
    server.data.mkdir()
    server.start()
    try:
        url = upload_cache(s3_client(server.endpoint), pipeline.root / "cache")
        out = pipeline.root / "train-local-shards"
        jobs = submit_training(
            slurm_nodes,
            pipeline,
            out,
            FOUR_NODES_ONE_RANK,
            CACHE=url,
            STK_TRAIN_S3_ENDPOINT_URL=server.endpoint,
            STK_TRAIN_LOCAL_CACHE_DIR=LOCAL_SHARDS,
            **S3_ENV,
            **ONE_RANK,
        )
        slurm_nodes.wait(jobs["train"], timeout=240)
    finally:
        server.kill()
    info = slurm_nodes.job(jobs["train"])
    assert info["JobState"] == "COMPLETED", f"{info}\n{log(pipeline.root, 'train', jobs['train'])}"
    shards = sorted(p.name for p in (pipeline.root / "cache" / "shards").iterdir())
    for node in NODES:
        local = slurm_nodes.node_tmp(node) / Path(LOCAL_SHARDS).name
        copies = [p.name.split("-", 1)[1] for p in local.iterdir()]  # named <url hash>-<shard>
        assert copies and len(set(copies)) == len(copies) and set(copies) <= set(shards), (node, copies, shards)
        shutil.rmtree(local)
    assert not Path(LOCAL_SHARDS).exists()  # nothing landed in the host's own /tmp
    (summary,) = summaries(log(pipeline.root, "train", jobs["train"]))
    assert summary["outcome"] == "finished" and summary["hosts"] == dict.fromkeys(NODES, 1), summary


def test_scan_and_cache_jobs_requeue_themselves_when_s3_stays_down(pipeline: Run, slurm_nodes: SlurmNodes):
    """S3 that answers nothing past --s3-retry-seconds is exit 69 in both commands; the templates
    requeue on it, as train.sbatch does."""
    (port,) = free_ports(1)
    down = {"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "S3_RETRY_SECONDS": "1"}
    root = slurm_nodes.shared / "s3-down"
    root.mkdir()
    scan_jobs = submit(
        slurm_nodes,
        root,
        [],
        FOUR_NODES_ONE_RANK,
        DATA="s3://stk-gone/images",
        MODEL=pipeline.model,
        RUN=str(root),
        **{f"STK_SCAN_{k}": v for k, v in down.items()},
    )
    cache_jobs = submit(
        slurm_nodes,
        root,
        ["--from", "cache"],
        FOUR_NODES_ONE_RANK,
        MODEL=pipeline.model,
        RUN=str(root),
        SCAN=str(pipeline.root / "scan"),
        CACHE="s3://stk-gone/cache",
        **{f"STK_CACHE_{k}": v for k, v in down.items()},
    )
    waiting = {"scan": scan_jobs["scan"], "cache": cache_jobs["cache"]}
    try:
        deadline = time.monotonic() + 240
        while waiting:
            for stage, job in list(waiting.items()):
                info = slurm_nodes.job(job)
                if int(info.get("Restarts", 0)) >= 1:
                    del waiting[stage]
                    text = log(root, stage, job)
                    assert "127.0.0.1" in text and "requeueing job" in text and "exit 69" in text, text
                assert info["JobState"] not in ("COMPLETED", "FAILED"), f"{stage}: {info}\n{log(root, stage, job)}"
            assert time.monotonic() < deadline, f"not requeued: {waiting}"
            time.sleep(0.3)
    finally:
        for job in [*scan_jobs.values(), *cache_jobs.values()]:
            slurm_nodes.run(["scancel", job], check=False)
        slurm_nodes.wait_idle()


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
    proc = subprocess.run(
        [str(PIPELINE), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
        env={"PATH": os.environ["PATH"], **env},
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert proc.stdout == "" and not (tmp_path / "logs").exists()
