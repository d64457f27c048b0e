"""Slurm across four nodes (tests/support/slurm_nodes.py: four namespaces on a bridge, one slurmd each): srun
and sbatch reach every node, MPI ranks under `srun --mpi=pmi2` form one world over four hostnames,
and each node's /tmp is its own. The templates across these nodes: tests/integration/test_slurm_pipeline.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support.slurm_nodes import SlurmNodes

pytestmark = pytest.mark.integration

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
    proc = slurm_nodes.run(
        ["timeout", "60", "srun", "--mpi=pmi2", "-N4", "--ntasks-per-node=2", PYTHON, "-c", RANKS], timeout=70
    )
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
