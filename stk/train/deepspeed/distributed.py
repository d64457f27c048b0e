"""Where the torch.distributed rendezvous is: rank, size and master address, set by stk itself.

DeepSpeed's own MPI discovery takes MASTER_ADDR from the first address of `hostname -I`, which
is wrong on hosts with several networks; so stk resolves the rendezvous from MPI (rank 0's own
address, broadcast), from Slurm, or from a launcher, and exports it before DeepSpeed looks.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from stk.cluster.slurm import Task, env_int, free_port, step_task
from stk.cluster.world import World
from stk.errors import InfraError, InputError
from stk.train.deepspeed.opbuilds import own_op_builds

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "DistEnv",
    "export_dist_env",
    "init_distributed",
    "resolve_dist_env",
]

# Variables a launcher (torchrun, the deepspeed launcher) sets; with all of them set, stk keeps them.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# How long a rank waits for its peers in one collective (and in the rendezvous) before it gives up
# on them: a peer that died or stopped answering ends the job within this time, not never. It must
# exceed the longest time one rank works alone (rank 0 exporting the final model).
COLLECTIVE_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the torch.distributed job and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node: str


def resolve_dist_env(world: World, environ: Mapping[str, str]) -> DistEnv:
    """The rendezvous, in this order: a complete launcher environment (kept as it is), MPI (rank
    0's address and a port, broadcast), an srun step without MPI, else one process on 127.0.0.1.

    Under MPI every rank must call this: it is collective."""
    if all(name in environ for name in LAUNCHER_VARS):
        return _from_launcher(world, environ)
    if world.comm is not None:
        return _from_mpi(world, environ)
    task = step_task(environ)
    if task is not None:
        return _from_slurm(task, environ)
    port = env_int(environ, "STK_MASTER_PORT") if "STK_MASTER_PORT" in environ else free_port()
    return DistEnv(0, 1, 0, 1, "127.0.0.1", port, world.node)


def export_dist_env(env: DistEnv, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the variables torch's env:// rendezvous reads; with all of them set, DeepSpeed's MPI
    discovery leaves MASTER_ADDR alone."""
    environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def init_distributed(env: DistEnv, backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Export `env` and start torch.distributed through DeepSpeed (nccl on GPUs, else gloo), with
    `timeout` for the rendezvous and for every collective after it. From here on DeepSpeed builds its
    ops under stk's build lock (stk.train.deepspeed.opbuilds)."""
    import deepspeed
    import torch

    export_dist_env(env)
    own_op_builds()  # before DeepSpeed builds its first op
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _default_group_timeout(timeout)
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    except (torch.distributed.DistStoreError, torch.distributed.DistNetworkError, TimeoutError) as exc:
        raise InfraError(
            f"the rendezvous at {env.master_addr}:{env.master_port} did not complete within {timeout} "
            f"(rank {env.rank} of {env.world_size} on {env.node}): check that all ranks started and that the "
            f"address is reachable from every node (STK_MASTER_ADDR / STK_MASTER_PORT choose another) ({exc})"
        ) from exc


def _default_group_timeout(timeout: datetime.timedelta) -> None:
    """Give the process groups that DeepSpeed makes itself (ZeRO's data-parallel group, with no
    timeout of its own) `timeout` too. torch gives such groups its module default (30 min for
    gloo, 10 for NCCL), not the world group's: a rank SIGSTOPped in ZeRO's gradient all-reduce
    held its peer for 30 minutes although the world group's timeout was 15 s. torch has no public
    setting for that default, so stk sets the module's."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def _from_launcher(world: World, environ: Mapping[str, str]) -> DistEnv:
    rank, size = env_int(environ, "RANK"), env_int(environ, "WORLD_SIZE")
    if world.comm is not None and (rank, size) != (world.rank, world.size):
        raise InputError(
            f"RANK={rank} WORLD_SIZE={size} in the environment disagree with MPI (rank {world.rank} of "
            f"{world.size}): unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        )
    local_size = env_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world.local_size
    return DistEnv(
        rank=rank,
        world_size=size,
        local_rank=env_int(environ, "LOCAL_RANK"),
        local_world_size=local_size,
        master_addr=environ["MASTER_ADDR"],
        master_port=env_int(environ, "MASTER_PORT"),
        node=world.node,
    )


def _from_mpi(world: World, environ: Mapping[str, str]) -> DistEnv:
    def rank0_endpoint() -> tuple[str, int]:
        # Rank 0's own host name resolved, never `hostname -I` (its first address may be any network).
        addr = environ.get("STK_MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        # A port free on rank 0 now beats one derived from the job id: two steps of a job may share a node.
        port = env_int(environ, "STK_MASTER_PORT") if "STK_MASTER_PORT" in environ else free_port()
        return addr, port

    addr, port = world.root_call(rank0_endpoint)
    return DistEnv(world.rank, world.size, world.local_rank, world.local_size, addr, port, world.node)


def _from_slurm(task: Task, environ: Mapping[str, str]) -> DistEnv:
    """srun without MPI: every task computes the same answer from Slurm's variables alone."""
    addr = environ.get("STK_MASTER_ADDR") or task.first_host()
    # no way to agree on a free port without talking: the one the job and step derive
    port = env_int(environ, "STK_MASTER_PORT") if "STK_MASTER_PORT" in environ else task.port
    return DistEnv(task.rank, task.size, task.local_rank, task.local_size, addr, port, task.node)
