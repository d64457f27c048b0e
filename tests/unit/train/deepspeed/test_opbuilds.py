"""DeepSpeed's op builds (stk.train.deepspeed.opbuilds): the build directory, the build lock that no killed process can
block, the bounded wait for a live build, and a stop signal before the first step, driven in this process and in small
helper processes. Real runs against a held lock: tests/integration/test_train_opbuilds.py."""

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
from support.opbuilds import SHM_OP, STOPPED_EARLY, baton

from stk.errors import ExitCode, InfraError, InputError
from stk.train.deepspeed.opbuilds import (
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
    from stk.train.deepspeed.opbuilds import build_lock

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
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), str(seconds)], stdout=subprocess.PIPE, text=True
    )
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
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_IN_CPP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
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
