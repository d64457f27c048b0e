"""Unit tests for stk.cluster.world in a single process: World without MPI, launcher and Slurm detection."""

from __future__ import annotations

import os
import socket

import pytest

from stk.cluster.slurm import gpu_count
from stk.cluster.world import World, get_world, launched_by_mpi
from stk.errors import InputError

MPI_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


# --- World() --------------------------------------------------------------------------------------


def test_single_process_world() -> None:
    world = World()
    assert (world.rank, world.size, world.local_rank, world.local_size) == (0, 1, 0, 1)
    assert world.is_root
    assert world.comm is None
    assert world.node == socket.gethostname()


def test_is_root_follows_the_rank() -> None:
    assert not World(rank=3, size=4).is_root
    assert World(rank=0, size=4).is_root


def test_collectives_without_a_communicator() -> None:
    world = World()
    payload = {"a": [1, 2, 3]}
    assert world.bcast(payload) is payload
    assert world.gather(payload) == [payload]
    assert world.gather(payload)[0] is payload  # type: ignore[index]
    assert world.allgather(7) == [7]
    assert world.scatter([["share of rank 0"]]) == ["share of rank 0"]
    world.barrier()  # a no-op, but it must not fail


def test_scatter_gives_rank_0_its_share() -> None:
    shares = [[1, 2], [3], []]
    assert World().scatter(shares) == [1, 2]


def test_root_call_returns_the_result_and_calls_once() -> None:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        return "planned"

    assert World().root_call(fn) == "planned"
    assert calls == [1]


def test_root_call_returns_falsy_results() -> None:
    assert World().root_call(lambda: None) is None
    assert World().root_call(lambda: 0) == 0
    assert World().root_call(lambda: (False, "x")) == (False, "x")


def test_root_call_raises_the_same_exception() -> None:
    error = InputError("no such directory")

    def fn() -> None:
        raise error

    with pytest.raises(InputError) as info:
        World().root_call(fn)
    assert info.value is error


def test_root_call_propagates_any_exception_type() -> None:
    def fn() -> int:
        return {}["missing"]  # type: ignore[no-any-return]

    with pytest.raises(KeyError, match="missing"):
        World().root_call(fn)


def test_abort_without_a_communicator_returns() -> None:
    # a single process is never aborted here (SystemExit would fail the test): the caller exits
    assert World().abort(1) is None
    assert World(rank=0, size=4).abort(1) is None  # no communicator: nothing to abort through


# --- get_world ---------------------------------------------------------------------------------------


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*MPI_VARIABLES, "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_get_world_without_a_launcher(no_launcher: pytest.MonkeyPatch) -> None:
    world = get_world()
    assert (world.rank, world.size, world.comm) == (0, 1, None)


def test_get_world_under_one_srun_task(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert get_world().size == 1


def test_get_world_refuses_srun_tasks_without_mpi(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("SLURM_STEP_NUM_TASKS", "4")
    with pytest.raises(InputError, match="--mpi=pmi2"):
        get_world()


# --- launched_by_mpi -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MPI_VARIABLES)
def test_launched_by_mpi_with_a_launcher_variable(name: str) -> None:
    assert launched_by_mpi({name: "0"})
    assert launched_by_mpi({"HOME": "/root", name: ""})


@pytest.mark.parametrize(
    "environ",
    [{}, {"HOME": "/root"}, {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, {"OMPI_MCA_foo": "1"}],
)
def test_not_launched_by_mpi(environ: dict[str, str]) -> None:
    assert not launched_by_mpi(environ)


def test_launched_by_mpi_reads_the_process_environment(no_launcher: pytest.MonkeyPatch) -> None:
    assert not launched_by_mpi()
    no_launcher.setenv("PMI_RANK", "2")
    assert launched_by_mpi()


# --- slurm_gpu_count ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS": "16"}, 16),
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "h100:8", "SLURM_JOB_NUM_NODES": "4"}, 32),
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "gpu:a100:4", "SLURM_JOB_NUM_NODES": "2"}, 8),
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "2"}, 16),
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "8"}, 8),  # one node when the count is missing
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS_ON_NODE": "4", "SLURM_NNODES": "3"}, 12),
        # SLURM_GPUS wins over the per-node count
        ({"SLURM_JOB_ID": "9", "SLURM_GPUS": "6", "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "4"}, 6),
    ],
)
def test_slurm_gpu_count(environ: dict[str, str], expected: int) -> None:
    assert gpu_count(environ) == expected


@pytest.mark.parametrize(
    "environ",
    [
        {},  # not in Slurm
        {"SLURM_GPUS": "8", "SLURM_GPUS_PER_NODE": "8"},  # stray variables without a job
        {"SLURM_JOB_ID": "9"},  # a job without GPUs
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "4"},
        {"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "h100:x"},
        {"SLURM_JOB_ID": "9", "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "two"},
    ],
)
def test_slurm_gpu_count_none(environ: dict[str, str]) -> None:
    assert gpu_count(environ) is None


def test_slurm_gpu_count_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert gpu_count(os.environ) is None
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_GPUS", "24")
    assert gpu_count(os.environ) == 24


def test_run_everywhere_returns_the_result_or_raises_the_error() -> None:
    world = World()
    assert world.run_everywhere(lambda: 42) == 42

    def fails() -> int:
        raise InputError("model does not load")

    with pytest.raises(InputError, match="does not load"):
        world.run_everywhere(fails)


# --- split_work ------------------------------------------------------------------------------------


def test_split_work_plans_works_and_finishes_in_one_process() -> None:
    from stk.cluster.world import split_work

    finished = split_work(
        World(),
        lambda: ("shared", [[1, 2, 3]]),
        lambda shared, share: (shared, sum(share)),
        lambda shared, results: (shared, results),
    )
    assert finished == ("shared", [("shared", 6)])


def test_split_work_raises_a_ranks_failure_as_reported_and_skips_the_finish() -> None:
    from stk.cluster.world import raised_on_every_rank, split_work

    def work(shared: None, share: list[int]) -> int:
        raise OSError("disk full")

    def finish(shared: None, results: list[int]) -> int:
        raise AssertionError("finished after a failure")

    with pytest.raises(InputError, match="rank 0: disk full") as raised:
        split_work(World(), lambda: (None, [[1]]), work, finish, lambda exc: InputError(f"rank 0: {exc}"))
    assert raised_on_every_rank(raised.value)
