"""Who am I in the job: rank, size, local rank and node, from MPI when launched by it.

mpi4py is imported only when the process was started by an MPI launcher (mpiexec, srun with
a PMI plugin), so a plain `stk-scan` on a laptop never initialises MPI.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from stk.cluster.slurm import step_size
from stk.errors import InputError

__all__ = [
    "World",
    "exit_now",
    "failed_rank",
    "get_world",
    "launched_by_mpi",
    "on_abort",
    "raised_everywhere",
    "raised_on_every_rank",
    "split_work",
]

T = TypeVar("T")
P = TypeVar("P")
S = TypeVar("S")
R = TypeVar("R")
U = TypeVar("U")

# Set on an exception that World raised on every rank at once, and where it first happened.
_EVERYWHERE = "stk_raised_on_every_rank"
_ORIGIN = "stk_failed_rank"
_abort_hooks: list[Callable[[int], None]] = []
_SCATTER_TAG, _GATHER_TAG = 7_001, 7_002  # World.scatter's and gather's messages, apart from any others
_ABORT_GRACE_SECONDS = 0.5  # for the launcher to forward a failing rank's last lines (World.abort)

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
        """Each rank its value, sent one rank at a time, and a list one item at a time: a collective
        scatter pickles every value at once on `root` (its own too), and a value can be a rank's share
        of a million-row table, in blocks."""
        if self.comm is None:
            assert values is not None
            return values[0]
        if self.rank != root:
            count, received = self.comm.recv(source=root, tag=_SCATTER_TAG)
            if count is not None:
                received = [self.comm.recv(source=root, tag=_SCATTER_TAG) for _ in range(count)]
            value: T = received
            return value
        assert values is not None
        for rank, value in enumerate(values):
            if rank == root:
                continue
            items: list[Any] = value if isinstance(value, list) else []
            self.comm.send((len(items), None) if items else (None, value), dest=rank, tag=_SCATTER_TAG)
            for item in items:
                self.comm.send(item, dest=rank, tag=_SCATTER_TAG)
        return values[root]

    def gather(self, value: T, root: int = 0) -> list[T] | None:
        """Every rank's value on `root` (None elsewhere), received one rank at a time, for the reason of scatter."""
        if self.comm is None:
            return [value]
        if self.rank != root:
            self.comm.send(value, dest=root, tag=_GATHER_TAG)
            return None
        return [value if rank == root else self.comm.recv(source=rank, tag=_GATHER_TAG) for rank in range(self.size)]

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
            raise _everywhere(value, 0, None)
        return value

    def run_everywhere(self, fn: Callable[[], T]) -> T:
        """Run `fn` on every rank; if it raised on any rank, raise that error on every rank, so
        that one rank's failure (a model that does not load) does not leave the others waiting."""
        try:
            result, failure = fn(), None
        except Exception as exc:  # re-raised below, on every rank
            result, failure = None, exc
        outcomes = self.allgather((self.node, failure))
        failures = [(rank, node, exc) for rank, (node, exc) in enumerate(outcomes) if exc is not None]
        if failures:
            rank, node, first = failures[0]
            raise _everywhere(first, rank, node)
        return result  # type: ignore[return-value]

    def abort(self, code: int) -> None:
        """End every rank now with `code`: one rank failed alone, and its peers would otherwise wait
        for it in their next collective forever. mpiexec (MPICH's hydra) exits with `code`;
        `srun --mpi=pmi2` cancels the step and exits 137, whatever the code."""
        if self.comm is None or self.size == 1:
            return
        _before_ending(code)
        # the launcher kills every process as soon as it hears of the abort, and output still on its
        # way through its forwarding is lost with them: the one line saying why must get out first
        time.sleep(_ABORT_GRACE_SECONDS)
        self.comm.Abort(code)


def exit_now(code: int) -> NoReturn:
    """End this process at once with `code`, from any thread and without unwinding (a stop signal before
    training starts, while the main thread may be blocked in C++). Under hydra's mpiexec the other ranks end
    with it and mpiexec exits `code`; under srun each rank that got the signal ends itself, so srun exits
    `code` too (an MPI_Abort would make it 137)."""
    _before_ending(code)
    os._exit(code)


def _before_ending(code: int) -> None:
    """What must happen before a process ends without unwinding: the abort hooks, the buffered output."""
    for hook in _abort_hooks:
        hook(code)
    sys.stderr.flush()
    sys.stdout.flush()


def _everywhere(exc: Exception, rank: int, node: str | None) -> Exception:
    if not hasattr(exc, _ORIGIN):  # the first rank to see it (an error gathered by rank 0 keeps its own)
        setattr(exc, _ORIGIN, (rank, node))
    setattr(exc, _EVERYWHERE, True)
    return exc


def raised_everywhere(exc: Exception, rank: int, node: str | None = None) -> Exception:
    """`exc`, marked as raised on every rank together where `rank` (on `node`) had it: for an error the ranks
    agreed on through another collective than World's (torch.distributed's, in a checkpoint save)."""
    return _everywhere(exc, rank, node)


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether World raised `exc` on every rank together (root_call, run_everywhere): then every
    rank ends by itself and one of them is enough to report it."""
    return bool(getattr(exc, _EVERYWHERE, False))


def failed_rank(exc: BaseException) -> tuple[int, str | None] | None:
    """The rank (and its node, when known) where an error raised on every rank happened."""
    origin: tuple[int, str | None] | None = getattr(exc, _ORIGIN, None)
    return origin


def on_abort(hook: Callable[[int], None]) -> None:
    """Call `hook(code)` just before World.abort or exit_now ends the process (they run no finally blocks)."""
    _abort_hooks.append(hook)


def get_world() -> World:
    if not launched_by_mpi():
        tasks = step_size(os.environ)
        if tasks > 1:
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


def split_work(
    world: World,
    plan: Callable[[], tuple[P, list[S]]],
    work: Callable[[P, S], R],
    finish: Callable[[P, list[R]], U],
    failure: Callable[[Exception], Exception] = lambda exc: exc,
) -> U:
    """Rank 0 plans (what every rank learns, one share per rank), each rank works on its share,
    rank 0 gathers the results and finishes; every rank returns what `finish` returned.

    A rank's failure (as `failure` reports it) travels through the gather instead of ending the
    rank, so no rank waits forever on a collective; rank 0 raises the first one on every rank, as
    it does its own planning and finishing errors (World.root_call)."""
    shares: list[list[S]] = []

    def root_plan() -> P:
        shared, split = plan()
        shares.append(split)
        return shared

    shared = world.root_call(root_plan)
    share = world.scatter(shares.pop() if world.is_root else None)  # the others' shares not held while working
    try:
        result, failed = work(shared, share), None
    except Exception as exc:  # reported through the gather
        result, failed = None, failure(exc)
    gathered = world.gather((result, failed))

    def root_finish() -> U:
        assert gathered is not None
        for _, exc in gathered:
            if exc is not None:
                raise exc
        return finish(shared, [r for r, _ in gathered])  # type: ignore[misc]  # no failure: every result is set

    return world.root_call(root_finish)
