"""stk-launch in a Slurm job: real runs of stk-train through DeepSpeed's MPI launcher (MPICH) on this machine, the
hosts taken from Slurm and SIGUSR2 reaching ranks started through srun."""

from __future__ import annotations

import json
import shlex

import pytest
from support.commands import STK_LAUNCH, train_env

from stk.models import Family

FAST = ["--batch-size", "1", "--lr", "1e-3", "--precision", "fp32", "-q"]


@pytest.mark.integration
def test_in_a_slurm_job_the_hosts_come_from_slurm_and_sigusr2_reaches_ranks_started_through_srun(
    slurm_cluster, setups, tmp_path
):
    """The way train.sbatch runs it: stk-launch in the batch script of a real (one-node) Slurm job.
    MPICH's mpirun then starts the ranks through srun, outside stk-launch's process tree."""
    model, cache = setups(Family.SD)
    out, hostfile = tmp_path / "run", tmp_path / "hosts"
    train = ["--cache", cache, "--model", model, "--output-dir", out, *FAST, "--epochs", 50, "--checkpoint-every", 0]
    extensions = train_env()["TORCH_EXTENSIONS_DIR"]
    script = f"""#!/bin/bash
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR={shlex.quote(extensions)}
{shlex.quote(STK_LAUNCH)} --hostfile {shlex.quote(str(hostfile))} -- {shlex.join(map(str, train))} > {tmp_path}/stdout &
launcher=$!
for _ in $(seq 900); do [ "$(wc -l < {out}/metrics.jsonl 2>/dev/null)" -ge 2 ] 2>/dev/null && break; sleep 0.2; done
kill -USR2 $launcher
wait $launcher
echo "stk-launch exited $?"
"""
    job = slurm_cluster.submit(script, options=["-N1", "-n2", "-c1", "--gpus-per-node=2"], timeout=240)
    log = slurm_cluster.output(job)
    assert "stk-launch exited 75" in log, log
    assert hostfile.read_text() == f"{slurm_cluster.node} slots=2\n"  # SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE
    assert "asking 2 rank(s) on this node to checkpoint" in log and "Traceback" not in log, log
    assert json.loads((tmp_path / "stdout").read_text())["outcome"] == "requeue"
    assert (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()).is_dir()
