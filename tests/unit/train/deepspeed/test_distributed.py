"""stk.train.deepspeed.distributed: each way of resolving the torch.distributed rendezvous, in this process."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import types
from typing import Any
from unittest import mock

import pytest
import torch

from stk.cluster.slurm import hostnames
from stk.cluster.world import World
from stk.errors import InfraError, InputError
from stk.train.deepspeed.distributed import DistEnv, export_dist_env, init_distributed, resolve_dist_env


class FakeComm:
    """A one-rank communicator: enough to take the MPI path in one process."""

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value


LAUNCHER = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}


def test_single_process_is_rank_0_of_1_on_loopback():
    env = resolve_dist_env(World(node="laptop"), {})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.master_addr == "127.0.0.1" and env.node == "laptop"
    assert 0 < env.master_port < 65536


def test_single_process_honours_stk_master_port():
    assert resolve_dist_env(World(), {"STK_MASTER_PORT": "31000"}).master_port == 31000


def test_launcher_variables_are_kept():
    env = resolve_dist_env(World(node="n1"), {**LAUNCHER, "LOCAL_WORLD_SIZE": "4"})
    assert env == DistEnv(3, 8, 1, 4, "10.1.2.3", 29400, "n1")


def test_incomplete_launcher_variables_are_ignored():
    environ = {k: v for k, v in LAUNCHER.items() if k != "MASTER_PORT"}
    assert resolve_dist_env(World(), environ).master_addr == "127.0.0.1"


def test_launcher_variables_that_disagree_with_mpi_are_refused():
    with pytest.raises(InputError, match="disagree with MPI"):
        resolve_dist_env(World(rank=0, size=2, comm=FakeComm()), LAUNCHER)


def test_mpi_takes_rank_0s_resolved_host_name(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "head")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"head": "10.9.8.7"}[name])
    world = World(rank=0, size=1, local_rank=0, local_size=1, node="head", comm=FakeComm())
    env = resolve_dist_env(world, {"SLURM_JOB_ID": "1234"})
    assert (env.rank, env.world_size, env.master_addr, env.node) == (0, 1, "10.9.8.7", "head")
    assert 0 < env.master_port < 65536


def test_mpi_honours_stk_master_addr_and_port():
    world = World(comm=FakeComm())
    env = resolve_dist_env(world, {"STK_MASTER_ADDR": "192.168.7.1", "STK_MASTER_PORT": "30001"})
    assert (env.master_addr, env.master_port) == ("192.168.7.1", 30001)


def test_mpi_bad_port_fails_on_every_rank():
    with pytest.raises(InputError, match="STK_MASTER_PORT"):
        resolve_dist_env(World(comm=FakeComm()), {"STK_MASTER_PORT": "any"})


SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "1",
    "SLURM_PROCID": "5",
    "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURMD_NODENAME": "gpu09",
}


def test_slurm_without_mpi():
    env = resolve_dist_env(World(), SLURM)
    assert env == DistEnv(5, 6, 1, 1, "gpu07", 20000 + 4242 + 1, "gpu09")
    assert resolve_dist_env(World(), SLURM).master_port == env.master_port  # the same on every task


def test_slurm_local_world_size_and_overrides():
    environ = {**SLURM, "SLURM_NODEID": "1", "STK_MASTER_ADDR": "10.0.0.1", "STK_MASTER_PORT": "30500"}
    env = resolve_dist_env(World(), environ)
    assert (env.local_world_size, env.master_addr, env.master_port) == (2, "10.0.0.1", 30500)


def test_slurm_first_host_without_scontrol(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert hostnames("node[01-04]")[0] == "node01"


def test_batch_script_without_srun_is_one_process():
    environ = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert resolve_dist_env(World(), environ).world_size == 1


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("login1", ["login1"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu[1,3-4],cpu-x[09-10]", ["gpu1", "gpu3", "gpu4", "cpu-x09", "cpu-x10"]),
        ("n[8-10]-ib", ["n8-ib", "n9-ib", "n10-ib"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]):
    assert hostnames(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[a-c]"])
def test_expand_nodelist_refuses_what_it_cannot_read(nodelist: str):
    with pytest.raises(InputError, match="node list"):
        hostnames(nodelist)


def test_export_sets_every_variable():
    environ: dict[str, str] = {"MASTER_ADDR": "192.0.2.2"}
    export_dist_env(DistEnv(1, 2, 1, 2, "10.0.0.5", 29999, "n"), environ)
    assert environ == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29999",
    }


def test_rendezvous_timeout_is_an_infra_error(monkeypatch: pytest.MonkeyPatch):
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> None:
        calls.append({**kwargs, "MASTER_ADDR": os.environ["MASTER_ADDR"]})
        raise torch.distributed.DistStoreError("Timed out after 601 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(init_distributed=init))
    env = DistEnv(0, 2, 0, 2, "10.0.0.5", 29999, "n")
    before = dict(os.environ)
    # init_distributed exports RANK, WORLD_SIZE, ...: left behind, they would reach every later mpiexec
    with (
        mock.patch.dict(os.environ),
        pytest.raises(InfraError, match=r"rendezvous at 10\.0\.0\.5:29999 did not complete"),
    ):
        init_distributed(env, timeout=datetime.timedelta(seconds=5))
    assert dict(os.environ) == before
    assert calls == [
        {
            "dist_backend": "nccl" if torch.cuda.is_available() else "gloo",
            "auto_mpi_discovery": False,
            "timeout": datetime.timedelta(seconds=5),
            "MASTER_ADDR": "10.0.0.5",
        }
    ]
