"""Who am I in the job: rank, size, local rank and node, from MPI when launched by it.

mpi4py is imported only when the process was started by an MPI launcher (mpiexec, srun with
a PMI plugin), so a plain `stk-scan` on a laptop never initialises MPI.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stk.errors import InputError

__all__ = ["World", "get_world", "launched_by_mpi", "slurm_gpu_count"]

T = TypeVar("T")

# Variables that MPI launchers set in every rank they start.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_by_mpi(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(name in env for name in _MPI_ENV)


@dataclass
class World:
    """The processes of this job. A single process is a world of size 1 with no communicator."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: str = field(default_factory=socket.gethostname)
    comm: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def bcast(self, value: T, root: int = 0) -> T:
        return value if self.comm is None else self.comm.bcast(value, root=root)

    def scatter(self, values: list[T] | None, root: int = 0) -> T:
        if self.comm is None:
            assert values is not None
            return values[0]
        return self.comm.scatter(values, root=root)

    def gather(self, value: T, root: int = 0) -> list[T] | None:
        return [value] if self.comm is None else self.comm.gather(value, root=root)

    def allgather(self, value: T) -> list[T]:
        return [value] if self.comm is None else self.comm.allgather(value)

    def root_call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 and give every rank its result, or raise its exception on every
        rank, so that an expected error on rank 0 ends all ranks the same way (no hang)."""
        outcome: tuple[bool, Any] | None = None
        if self.is_root:
            try:
                outcome = (True, fn())
            except Exception as exc:  # re-raised below, on every rank
                outcome = (False, exc)
        ok, value = self.bcast(outcome)  # type: ignore[misc]  # set on rank 0, received elsewhere
        if not ok:
            raise value
        return value

    def run_everywhere(self, fn: Callable[[], T]) -> T:
        """Run `fn` on every rank; if it raised on any rank, raise that error on every rank, so
        that one rank's failure (a model that does not load) does not leave the others waiting."""
        try:
            result, failure = fn(), None
        except Exception as exc:  # re-raised below, on every rank
            result, failure = None, exc
        failures = [f for f in self.allgather(failure) if f is not None]
        if failures:
            raise failures[0]
        return result  # type: ignore[return-value]

    def abort(self, code: int) -> None:
        """End every rank now; used when one rank fails outside a collective step."""
        if self.comm is not None and self.size > 1:
            self.comm.Abort(code)


def get_world() -> World:
    if not launched_by_mpi():
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
        if tasks.isdigit() and int(tasks) > 1:
            # srun without a PMI plugin: N processes that would each think they are alone
            raise InputError(
                f"started by srun as {tasks} tasks without MPI: use `srun --mpi=pmi2` (MPICH) or "
                "`srun --mpi=pmix` (OpenMPI) so the tasks can share the work"
            )
        return World()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    world = World(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local.Get_rank(),
        local_size=local.Get_size(),
        comm=comm,
    )
    local.Free()
    return world


def slurm_gpu_count(environ: dict[str, str] | None = None) -> int | None:
    """GPUs in the Slurm allocation, or None outside Slurm or when it holds no GPUs."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env:
        return None
    total = env.get("SLURM_GPUS", "").rsplit(":", 1)[-1]  # "32" or "h100:32"
    if total.isdigit():
        return int(total)
    per_node = env.get("SLURM_GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or ""
    per_node = per_node.rsplit(":", 1)[-1]  # "h100:8" -> "8"
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if per_node.isdigit() and nodes.isdigit():
        return int(per_node) * int(nodes)
    return None
