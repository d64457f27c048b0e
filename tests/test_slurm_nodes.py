"""Slurm across four nodes (tests/slurm_nodes.py: four namespaces on a bridge, one slurmd each): srun
and sbatch reach every node, MPI ranks under `srun --mpi=pmi2` form one world over four hostnames,
each node's /tmp is its own, and sbatch/pipeline.sh runs scan -> cache -> train over 4 nodes x 2
tasks with the templates unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import train_env
from slurm_cluster import FINISHED
from slurm_nodes import SlurmNodes

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / "sbatch" / "pipeline.sh"
PYTHON = sys.executable
NODES = ["node1", "node2", "node3", "node4"]
RANKS = "from mpi4py import MPI; import socket; print(MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, socket.gethostname())"


def test_four_idle_nodes_and_srun_reaches_each_by_its_hostname(slurm_nodes: SlurmNodes):
    assert slurm_nodes.states() == dict.fromkeys(NODES, "idle")
    proc = slurm_nodes.run(["timeout", "30", "srun", "-N4", "hostname"], timeout=40)
    assert sorted(proc.stdout.split()) == NODES
    for node in NODES:
        assert slurm_nodes.node_exec(node, ["hostname"]).stdout.strip() == node


def test_mpi_ranks_under_srun_pmi2_are_one_world_over_four_hosts(slurm_nodes: SlurmNodes):
    proc = slurm_nodes.run(["timeout", "60", "srun", "--mpi=pmi2", "-N4", "--ntasks-per-node=2", PYTHON, "-c", RANKS],
                           timeout=70)  # fmt: skip
    ranks = [line.split() for line in proc.stdout.splitlines()]
    assert sorted(int(rank) for rank, _, _ in ranks) == list(range(8)), proc.stdout
    assert {size for _, size, _ in ranks} == {"8"}, proc.stdout
    hosts = [host for _, _, host in ranks]
    assert sorted(set(hosts)) == NODES and all(hosts.count(node) == 2 for node in NODES), proc.stdout


def test_each_node_has_its_own_tmp_and_sees_the_shared_dir(slurm_nodes: SlurmNodes):
    probe = f"stk-probe-{os.getpid()}"
    (slurm_nodes.shared / probe).write_text("shared\n")
    try:
        slurm_nodes.node_exec("node1", ["sh", "-c", f"echo node1 > /tmp/{probe}"])
        assert (slurm_nodes.node_tmp("node1") / probe).read_text() == "node1\n"
        assert not (slurm_nodes.node_tmp("node2") / probe).exists()
        assert not Path("/tmp", probe).exists()
        assert slurm_nodes.node_exec("node2", ["test", "-e", f"/tmp/{probe}"], check=False).returncode == 1
        for node in NODES:
            assert slurm_nodes.node_exec(node, ["cat", str(slurm_nodes.shared / probe)]).stdout == "shared\n"
            assert slurm_nodes.node_exec(node, [PYTHON, "-c", "import stk"]).returncode == 0
    finally:
        (slurm_nodes.shared / probe).unlink()
        (slurm_nodes.node_tmp("node1") / probe).unlink(missing_ok=True)


def test_sbatch_job_over_four_nodes_completes_with_its_output(slurm_nodes: SlurmNodes):
    job = slurm_nodes.submit("#!/bin/bash\nsrun hostname\n", options=["-N4", "--ntasks-per-node=1"], timeout=60)
    assert slurm_nodes.job(job)["JobState"] == "COMPLETED", slurm_nodes.output(job)
    assert sorted(slurm_nodes.output(job).split()) == NODES


SIZE = ["--nodes=4", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=00:20:00"]
SETTINGS = {
    "STK_SCAN_RESOLUTION": "64", "STK_SCAN_ALIGNMENT": "64", "STK_SCAN_BATCH_SIZE": "1",
    "STK_SCAN_ALLOW_OVERSUBSCRIPTION": "1", "STK_SCAN_QUIET": "1",
    "STK_CACHE_DTYPE": "float32", "STK_CACHE_QUIET": "1",
    "STK_TRAIN_BATCH_SIZE": "1", "STK_TRAIN_PRECISION": "fp32", "STK_TRAIN_LR": "1e-3", "STK_TRAIN_MAX_STEPS": "3",
    "STK_TRAIN_QUIET": "1",
}  # fmt: skip


# Slurm 22.05's mpi/pmi2 plugin reads a PMI-1 request with one read() of at most 1024 bytes
# (src/plugins/mpi/pmi2/pmi1.c handle_pmi1_cmd: "TODO: read until newline"); MPICH's PMI-1 client
# sends an allgather value of more than one segment as `cmd=put ... key=-allgather-N-R-seg-I/J
# value=...` lines longer than that. The tail is then parsed as a request of its own, the rank never
# gets its answer and the step hangs. Across nodes stk-cache's `srun --mpi=pmi2` step meets it about
# every other run here (never on one node: no such allgather there). Known, outside stk: the test
# reports it as an expected failure instead of waiting out the hang, and fails on anything else.
PMI1_SPLIT = "mpi/pmi2: request not begin with 'cmd='"
PMI1_GRACE_S = 30


def _log(run: Path, stage: str, job: str) -> str:
    path = run / "logs" / f"stk-{stage}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


def _summaries(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"output_dir"')]


def _finish(cluster: SlurmNodes, run: Path, stage: str, job: str, timeout: float) -> dict[str, str]:
    """Wait for the stage's job; an expected failure when it hangs on the PMI-1 split above."""
    deadline, split_at = time.monotonic() + timeout, None
    while (info := cluster.job(job))["JobState"] not in FINISHED:
        if split_at is None and PMI1_SPLIT in _log(run, stage, job):
            split_at = time.monotonic()
        if split_at is not None and time.monotonic() - split_at > PMI1_GRACE_S:
            pytest.xfail(f"{stage}: Slurm's pmi2 plugin split an MPICH PMI-1 request and the step hangs "
                         f"(see PMI1_SPLIT):\n{_log(run, stage, job)[-3000:]}")  # fmt: skip
        assert time.monotonic() < deadline, (
            f"{stage} still {info['JobState']} after {timeout} s:\n{_log(run, stage, job)}"
        )
        time.sleep(0.5)
    return info


def test_pipeline_scan_cache_train_over_four_nodes_with_the_templates_unchanged(slurm_nodes: SlurmNodes):
    run = slurm_nodes.shared / "pipeline"
    generate_dataset(str(run / "images"), count=24, seed=3, min_side=64, max_side=80)
    model = build_tiny_model(Family.SD, str(run / "model"))
    env = {**train_env(), **SETTINGS, "DATA": str(run / "images"), "MODEL": model, "RUN": str(run)}
    env["SLURM_CONF"] = slurm_nodes.env["SLURM_CONF"]
    env["PATH"] = f"{Path(PYTHON).parent}:{os.environ['PATH']}"
    proc = subprocess.run([str(PIPELINE), "--", *SIZE], capture_output=True, text=True, env=env, cwd=run, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs = dict(line.split() for line in proc.stdout.splitlines())
    assert list(jobs) == ["scan", "cache", "train"]
    try:
        for stage, job in jobs.items():
            info = _finish(slurm_nodes, run, stage, job, timeout=180)
            assert info["JobState"] == "COMPLETED", f"{stage}: {info}\n{_log(run, stage, job)}"
            assert info["NodeList"] == "node[1-4]", info
    finally:
        for job in jobs.values():
            slurm_nodes.run(["scancel", job], check=False)
        for job in jobs.values():
            slurm_nodes.wait(job, timeout=60)
    assert (run / "scan" / "metadata.parquet").exists()
    assert (run / "cache" / "manifest.json").exists()
    (summary,) = _summaries(_log(run, "train", jobs["train"]))
    assert summary["outcome"] == "finished" and summary["steps"] == 3, summary
    assert (run / "train" / "final" / "model_index.json").exists()
