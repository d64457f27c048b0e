"""DeepSpeed's op builds (stk.train.opbuilds): the build directory, the build lock that no killed process can
block, the bounded wait for a live build, and a stop signal before the first step.

Unit tests drive the lock in this process and in small helper processes; the end-to-end tests run real stk-train
jobs (mpiexec -n 2, DeepSpeed on the CPU) against the session's build directory while this process holds the build
lock and a torch baton as a build does."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.helpers import EXTENSIONS_DIR, FAST, mpi_rank_pids, run_train, train_command, train_env

from stk.errors import ExitCode, InfraError, InputError
from stk.models import Family
from stk.train import opbuilds
from stk.train.opbuilds import (
    DEFAULT_WAIT_S,
    LOCK_NAME,
    WAIT_ENV,
    build_lock,
    default_build_dir,
    own_op_builds,
    prefer_own_build_tools,
    remove_stale_batons,
    use_build_dir,
    wait_seconds,
)
from stk.train.stopping import StopSignals

SHM_OP = "deepspeed_shm_comm"  # what init_distributed builds on the CPU
STOPPED_EARLY = "received before the first training step"


# --- the build directory ------------------------------------------------------------------------------------------


def test_the_build_directory_is_per_python_torch_host_and_environment(monkeypatch, tmp_path):
    import importlib.metadata

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = default_build_dir()
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    torch = importlib.metadata.version("torch")
    assert Path(here).parent == tmp_path / "stk" / "torch-extensions"
    assert Path(here).name.startswith(f"{python}-torch{torch}-{socket.gethostname()}-")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert default_build_dir() != here  # another environment
    monkeypatch.setattr(socket, "gethostname", lambda: "node2")
    assert "-node2-" in default_build_dir()  # another node sharing $HOME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_build_dir().startswith(str(tmp_path / "home" / ".cache" / "stk" / "torch-extensions") + os.sep)


def test_torch_extensions_dir_set_by_the_user_overrides_the_default(tmp_path):
    environ = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine"), "XDG_CACHE_HOME": str(tmp_path)}
    assert use_build_dir(environ) == str(tmp_path / "mine")
    for unset in ({}, {"TORCH_EXTENSIONS_DIR": ""}):
        environ = {**unset, "XDG_CACHE_HOME": str(tmp_path)}
        assert use_build_dir(environ) == environ["TORCH_EXTENSIONS_DIR"] == default_build_dir(environ)


def test_the_wait_for_a_build_defaults_to_half_an_hour_and_takes_seconds():
    assert wait_seconds({}) == DEFAULT_WAIT_S == 1800
    assert wait_seconds({WAIT_ENV: "2.5"}) == 2.5
    for bad in ("soon", "0", "-3", "nan"):
        with pytest.raises(InputError, match=WAIT_ENV):
            wait_seconds({WAIT_ENV: bad})


def test_the_ninja_beside_this_python_comes_first_on_path():
    """DeepSpeed's op builds take the first ninja on PATH; pip's (beside this python) must win over a
    system one, whose build log it cannot read (every op would be rebuilt)."""
    own = os.path.dirname(sys.executable)
    assert os.path.isfile(os.path.join(own, "ninja")), "pip's ninja (a DeepSpeed dependency) is missing"
    environ = {"PATH": os.pathsep.join(["/usr/bin", own, "/bin"])}
    prefer_own_build_tools(environ)
    assert environ["PATH"].split(os.pathsep) == [own, "/usr/bin", "/bin"]
    prefer_own_build_tools(environ)
    assert environ["PATH"].split(os.pathsep) == [own, "/usr/bin", "/bin"]


# --- the build lock -----------------------------------------------------------------------------------------------


def baton(directory: Path, op: str) -> Path:
    (directory / op).mkdir(parents=True, exist_ok=True)
    return directory / op / "lock"


def test_batons_that_no_live_process_holds_are_removed_and_a_live_one_kept(tmp_path, caplog):
    stale, live = baton(tmp_path, "cpu_adam"), baton(tmp_path, SHM_OP)
    stale.touch()
    fd = os.open(live, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while it builds
    try:
        assert remove_stale_batons(str(tmp_path)) == [str(stale)]
    finally:
        os.close(fd)
    assert live.exists() and not stale.exists()
    assert [r.getMessage() for r in caplog.records if "removed" in r.getMessage()] == [
        f"removed {stale}, left by a build that was killed before it finished; the op builds again"
    ]


HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from stk.train.opbuilds import build_lock

    with build_lock(sys.argv[1], 60):
        os.makedirs(os.path.join(sys.argv[1], "op"), exist_ok=True)
        fd = os.open(os.path.join(sys.argv[1], "op", "lock"), os.O_CREAT | os.O_EXCL)
        print("building", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


@contextlib.contextmanager
def holder(directory: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process that takes the build lock and starts a build (a torch baton held open) for `seconds`."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(seconds)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "building\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_build_killed_mid_way_blocks_nothing_its_baton_is_removed(tmp_path):
    with holder(tmp_path, 60) as proc:
        with pytest.raises(InfraError), build_lock(str(tmp_path), 0.3):
            pass  # alive: its lock holds
        proc.kill()  # scancel, an MPI_Abort: its baton stays behind
        proc.wait()
        assert baton(tmp_path, "op").exists()
        started = time.monotonic()
        with build_lock(str(tmp_path), 5):
            assert time.monotonic() - started < 1
            assert not baton(tmp_path, "op").exists()
        assert (tmp_path / LOCK_NAME).exists()  # the lock file stays: only the kernel's lock on it comes and goes


def test_a_live_build_is_waited_for_and_past_the_bound_the_error_names_the_directory(tmp_path):
    with holder(tmp_path, 1.5) as proc:
        started = time.monotonic()
        with build_lock(str(tmp_path), 30):
            assert time.monotonic() - started > 0.5  # it waited for the holder to end
    with holder(tmp_path, 60) as other, pytest.raises(InfraError) as caught, build_lock(str(tmp_path), 0.5):
        pass  # a holder that does not end within the bound
    message = str(caught.value)
    assert f"DeepSpeed's ops in {tmp_path} (pid {other.pid} on {socket.gethostname()} since" in message, message
    assert WAIT_ENV in message and "\n" not in message
    assert proc.returncode is not None and caught.value.exit_code == ExitCode.INFRA


def test_torchs_load_runs_under_the_build_lock_with_stale_batons_gone(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    seen = []

    def load(name, *args, **kwargs):
        with open(tmp_path / LOCK_NAME) as other:  # another process's view: the lock is held now
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("unlocked")
            except BlockingIOError:
                seen.append("locked")
        seen.append(baton(tmp_path, name).exists())
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ["PATH"])  # own_op_builds puts this python's ninja first
    assert own_op_builds() == own_op_builds() == str(tmp_path)
    assert cpp_extension.load is not load and cpp_extension.load.__wrapped__ is load  # wrapped once
    baton(tmp_path, "cpu_adam").touch()
    assert cpp_extension.load("cpu_adam", sources=[]) == "cpu_adam"
    assert seen == ["locked", False]


# --- a stop signal before the first step --------------------------------------------------------------------------


def test_a_stop_signal_before_the_loop_ends_the_run_once_and_after_it_waits_for_the_step(caplog):
    ended: list[int] = []
    signals = StopSignals(ended.append).install()
    try:
        signal.raise_signal(signal.SIGTERM)  # the handler and the watching thread both see it: one end
        time.sleep(0.2)
        assert ended == [ExitCode.REQUEUE] and signals.received is None
        assert sum(STOPPED_EARLY in r.getMessage() for r in caplog.records) == 1
        signals.defer()  # the step loop runs
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert signals.received == "SIGUSR2" and ended == [ExitCode.REQUEUE]  # recorded: the first names the reason
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1 and not any(t.name == "stk-stop-signals" for t in threading.enumerate())


BLOCKED_IN_CPP = textwrap.dedent(
    """
    import datetime
    from torch.distributed import TCPStore
    from stk.train.stopping import StopSignals

    StopSignals().install()
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=120))
    print("waiting", flush=True)
    store.wait(["a peer that never comes"])  # the rendezvous: C++, the GIL released, Python's handlers held back
    """
)


def test_a_stop_signal_ends_a_process_blocked_in_the_rendezvous_at_once():
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_CPP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.REQUEUE, stderr
    assert time.monotonic() - started < 5  # not the store's 120 s
    assert stderr.count(STOPPED_EARLY) == 1 and "SIGTERM" in stderr, stderr


# --- real stk-train runs --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def building(op: str = SHM_OP) -> Iterator[Path]:
    """This process builds `op` into the session's build directory as stk does: the build lock held and torch's
    baton created and held open."""
    with build_lock(str(EXTENSIONS_DIR), 60):
        path = baton(EXTENSIONS_DIR, op)
        fd = os.open(path, os.O_CREAT | os.O_EXCL)
        try:
            yield path
        finally:
            os.close(fd)
            path.unlink()


def wait_until_waiting(pids: list[int], proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Until every process in `pids` has the build lock open (it waits for it), or fail if `proc` ended first."""
    lock = os.path.realpath(EXTENSIONS_DIR / LOCK_NAME)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if all(lock in open_files(pid) for pid in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not reach the build lock (exit {proc.poll()})")


def open_files(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we look
            found.add(os.readlink(fd))
    return found


def rank_pids(proc: subprocess.Popen[str], ranks: int) -> list[int]:
    deadline = time.monotonic() + 60
    while len(found := mpi_rank_pids(proc.pid, "stk.cli.train")) < ranks and time.monotonic() < deadline:
        time.sleep(0.1)
    return [found[r] for r in range(ranks)]


def train_args(setups, tmp_path: Path, *extra: str) -> list[str]:
    model, cache = setups(Family.SD)
    return ["--cache", cache, "--model", model, "--output-dir", tmp_path / "run", *FAST, *extra]


@pytest.mark.integration
def test_stale_batons_left_by_killed_builds_do_not_stop_the_next_run(setups, tmp_path):
    """A killed build's torch baton for the shared-memory op (init_distributed) and for CPU Adam (the offloaded
    optimizer, built in deepspeed.initialize): the next run removes them, saying so, and trains."""
    stale = [baton(EXTENSIONS_DIR, op) for op in (SHM_OP, "cpu_adam")]
    for path in stale:
        path.touch()
    proc = run_train(train_args(setups, tmp_path, "--max-steps", "1", "--deepspeed", "zero2-offload"), timeout=540)
    assert proc.returncode == 0, proc.stderr  # at worst after one cold build of each
    assert not any(path.exists() for path in stale)
    assert all(f"removed {path}, left by a build that was killed" in proc.stderr for path in stale), proc.stderr


@pytest.mark.integration
def test_a_run_waits_for_a_live_build_beside_it_then_trains(setups, tmp_path):
    args = train_args(setups, tmp_path, "--max-steps", "1")
    proc = subprocess.Popen(train_command(args, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=train_env())  # fmt: skip
    try:
        with building() as live:
            wait_until_waiting(rank_pids(proc, 2), proc)
            time.sleep(opbuilds._SAY_WAITING_AFTER_S + 1)
            assert live.exists() and proc.poll() is None  # neither taken for a stale one nor gone past
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert stderr.count(f"waiting for another process's build of DeepSpeed's ops in {EXTENSIONS_DIR}") == 2, stderr
    assert "removed" not in stderr


@pytest.mark.integration
def test_a_wait_past_the_bound_is_exit_69_naming_the_directory(setups, tmp_path):
    proc = subprocess.Popen(train_command(train_args(setups, tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**train_env(), WAIT_ENV: "2"})  # fmt: skip
    try:
        with building():
            _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.INFRA, stderr
    lines = [line for line in stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and f"of DeepSpeed's ops in {EXTENSIONS_DIR} (pid {os.getpid()}" in lines[0], stderr


@pytest.mark.integration
def test_sigterm_while_waiting_for_a_build_ends_the_run_at_once_for_requeue(setups, tmp_path):
    proc = subprocess.Popen(train_command(train_args(setups, tmp_path), 2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=train_env())  # fmt: skip
    try:
        with building():
            ranks = rank_pids(proc, 2)
            wait_until_waiting(ranks, proc)
            started = time.monotonic()
            os.kill(ranks[1], signal.SIGTERM)  # one rank: mpiexec ends the other
            _, stderr = proc.communicate(timeout=60)
            elapsed = time.monotonic() - started
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.REQUEUE, stderr
    assert elapsed < 10, elapsed
    assert stderr.count(STOPPED_EARLY) == 1 and "SIGTERM" in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.integration
def test_make_installs_step_builds_the_ops_stk_uses(tmp_path):
    """`python -m stk.train.opbuilds` (make install) into the session's directory: the shared-memory op and CPU
    Adam, where TORCH_EXTENSIONS_DIR says, not in the default directory."""
    env = {**train_env(), "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "stk.train.opbuilds"], capture_output=True, text=True, env=env,
                          timeout=540)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"stk: DeepSpeed's ops {SHM_OP}, cpu_adam ready in {EXTENSIONS_DIR} (" in proc.stdout, proc.stdout
    assert all((EXTENSIONS_DIR / op / f"{op}.so").is_file() for op in (SHM_OP, "cpu_adam"))
    assert not (tmp_path / "stk").exists()  # TORCH_EXTENSIONS_DIR given: the default is not used
