"""DeepSpeed's op builds: where they go, and one build at a time that no killed process can block.

DeepSpeed JIT-builds its C++ ops (the CPU shared-memory allreduce in `init_distributed`, CPU Adam for an
offloaded optimizer, others on GPUs) through `torch.utils.cpp_extension.load`, under torch's FileBaton: a plain
`<dir>/<op>/lock` file, created with O_EXCL, that names no owner. A process killed mid-build (an MPI_Abort from
a peer's early error, scancel, preemption) leaves it, and every later load of that op waits for it forever.

So stk-train wraps torch's `load` (`own_op_builds`): each load takes an exclusive `flock` on
`<dir>/stk-build.lock` (the kernel drops a dead process's flock), removes the batons that no live process holds,
and waits for a live build at most `STK_BUILD_WAIT_SECONDS`. Only torch's load is inside the lock: loading a
built op takes milliseconds there, so ranks on one node barely queue (DeepSpeed's own start of an op, its CPU
probes, ~2 s for CPU Adam, stays outside).

The directory is per environment and per host (two venvs, or two nodes sharing $HOME, never share one) unless
TORCH_EXTENSIONS_DIR says otherwise. `python -m stk.train.deepspeed.opbuilds` builds the ops stk uses on this machine
(`make install` runs it), so the first training run does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.metadata
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from stk.errors import InfraError, InputError, StkError
from stk.log import get_logger

__all__ = [
    "DEFAULT_WAIT_S",
    "LOCK_NAME",
    "WAIT_ENV",
    "build_lock",
    "default_build_dir",
    "own_op_builds",
    "prebuild_ops",
    "prefer_own_build_tools",
    "remove_stale_batons",
    "use_build_dir",
    "wait_seconds",
]

log = get_logger("train.ops")

LOCK_NAME = "stk-build.lock"
WAIT_ENV = "STK_BUILD_WAIT_SECONDS"
# Longer than any cold build (CPU Adam: ~85 s on 2 cores; the GPU ops with nvcc: minutes), shorter than a job.
DEFAULT_WAIT_S = 1800.0
# The ops stk-train starts here: the shared-memory allreduce (init_distributed, on the CPU) and CPU Adam (an
# offloaded optimizer, every accelerator). An op this accelerator lacks or cannot build is skipped.
STK_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")
_POLL_S = 0.05
_SAY_WAITING_AFTER_S = 5.0


def default_build_dir(environ: Mapping[str, str] = os.environ) -> str:
    """$XDG_CACHE_HOME/stk/torch-extensions/py<X.Y>-torch<version>-<host>-<venv digest>: a build made by another
    python, torch, machine or environment is never loaded here, and a lock left by one never blocks another."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    torch = importlib.metadata.version("torch")  # with its local part: 2.13.0+cpu, 2.13.0+cu128
    venv = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    return os.path.join(cache, "stk", "torch-extensions", f"{python}-torch{torch}-{socket.gethostname()}-{venv}")


def wait_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """How long a load waits for another process's build: $STK_BUILD_WAIT_SECONDS, else DEFAULT_WAIT_S."""
    text = environ.get(WAIT_ENV, "")
    if not text:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"{WAIT_ENV}={text!r}: give the seconds to wait for another process's op build (> 0)")
    return value


def prefer_own_build_tools(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put this python's bin directory first on PATH. DeepSpeed builds its C++ ops with the first `ninja` on PATH;
    pip's ninja, installed beside this python for DeepSpeed, and a system one (Debian's comes with cmake) keep
    build logs the other cannot read, so runs that alternate between them rebuild every op, ~30 s each on 2 cores."""
    own = os.path.dirname(sys.executable)
    path = environ.get("PATH", os.defpath)
    if not os.path.isfile(os.path.join(own, "ninja")) or path.split(os.pathsep)[0] == own:
        return
    environ["PATH"] = os.pathsep.join([own, *(entry for entry in path.split(os.pathsep) if entry != own)])


def use_build_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """The build directory: TORCH_EXTENSIONS_DIR when the user set it, else default_build_dir(), set there."""
    if not environ.get("TORCH_EXTENSIONS_DIR"):
        environ["TORCH_EXTENSIONS_DIR"] = default_build_dir(environ)
    return environ["TORCH_EXTENSIONS_DIR"]


def own_op_builds() -> str:
    """Make every later DeepSpeed op build of this process go to the build directory (use_build_dir) under the
    build lock; return the directory. Call it before DeepSpeed starts: DeepSpeed looks torch's `load` up each
    time it builds an op, so the wrapper sees every build."""
    from torch.utils import cpp_extension

    directory = use_build_dir()
    prefer_own_build_tools()
    if not getattr(cpp_extension.load, "stk_locked", False):
        cpp_extension.load = _locked(cpp_extension.load)
    return directory


def _locked(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def locked_load(name: str, *args: Any, **kwargs: Any) -> Any:
        directory = os.environ["TORCH_EXTENSIONS_DIR"]  # read when building, as torch reads it
        with build_lock(directory, wait_seconds()) as deadline:
            other = f"another program's build of DeepSpeed's op {name} in {directory}"
            _wait(lambda: not _live_baton(directory, name), deadline, other)
            return load(name, *args, **kwargs)

    locked_load.stk_locked = True  # type: ignore[attr-defined]  # own_op_builds wraps once
    return locked_load


@contextlib.contextmanager
def build_lock(directory: str, wait_s: float) -> Iterator[float]:
    """Hold the exclusive build lock of `directory`, waiting at most `wait_s` for the process that holds it
    (exit 69 past that), with the stale batons removed; yields the deadline (time.monotonic) of the wait."""
    os.makedirs(directory, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with open(os.path.join(directory, LOCK_NAME), "a+") as f:
        other = f"another process's build of DeepSpeed's ops in {directory}"
        _wait(lambda: _try_flock(f.fileno()), deadline, other, lambda: _holder(f))
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")
            f.flush()
            remove_stale_batons(directory)
            yield deadline
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def remove_stale_batons(directory: str) -> list[str]:
    """Remove each `<directory>/<op>/lock` that no live process holds open, and say so. Every stk process builds
    under the build lock, so a baton found by its holder was left by a build that was killed; torch's FileBaton
    keeps its file open while it builds, which spares a live build by some other program."""
    removed = []
    for baton in sorted(glob.glob(os.path.join(glob.escape(directory), "*", "lock"))):
        if _held_open(baton):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(baton)
            removed.append(baton)
            log.warning("removed %s, left by a build that was killed before it finished; the op builds again", baton)
    return removed


def _live_baton(directory: str, name: str) -> bool:
    baton = os.path.join(directory, name, "lock")
    return os.path.exists(baton) and _held_open(baton)


def _held_open(path: str) -> bool:
    """Whether a process on this host has `path` open (scans /proc/*/fd; other users' are unreadable)."""
    target = os.path.realpath(path)
    for fds in glob.glob("/proc/[0-9]*/fd"):
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for name in names:
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(fds, name)) == target:
                    return True
    return False


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(f: Any) -> str:
    f.seek(0)
    return f.read().strip() or "a process"


def _wait(done: Callable[[], bool], deadline: float, what: str, who: Callable[[], str] = lambda: "live") -> None:
    """Poll `done` until it holds; one line if that takes a while, InfraError (exit 69) past `deadline`."""
    started, said = time.monotonic(), False
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise InfraError(
                f"waited {now - started:.0f} s for {what} ({who()}) without an end: rerun later, or elsewhere; "
                f"if nothing builds there, remove that directory ({WAIT_ENV} sets the wait)"
            )
        if not said and now - started > _SAY_WAITING_AFTER_S:
            log.warning("waiting for %s (%s)", what, who())
            said = True
        time.sleep(_POLL_S)


def prebuild_ops(names: tuple[str, ...] = STK_OPS) -> dict[str, str | None]:
    """Build (or load, when built) the ops stk-train uses on this machine's accelerator, under the build lock:
    {op: None when ready, else why it did not build}. One that cannot build here (no C++ compiler) is stk-train's
    to build at first use, where it needs it; a wait past the bound raises InfraError."""
    own_op_builds()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    outcome: dict[str, str | None] = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        try:
            builder.load(verbose=False)
            outcome[builder.NAME] = None
        except StkError:
            raise
        except Exception as exc:  # a compiler error, a missing compiler: told, and left to the first run
            outcome[builder.NAME] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return outcome


def main() -> None:
    """`make install`: the ops stk uses, built once, so the first training run does not build them."""
    started = time.monotonic()
    try:
        outcome = prebuild_ops()
    except StkError as exc:
        print(f"stk: {exc}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
    directory = os.environ["TORCH_EXTENSIONS_DIR"]
    ready = [name for name, failure in outcome.items() if failure is None]
    print(
        f"stk: DeepSpeed's ops {', '.join(ready) or '(none)'} ready in {directory} ({time.monotonic() - started:.0f} s)"
    )
    for name, failure in outcome.items():
        if failure is not None:
            print(f"stk: DeepSpeed's op {name} did not build ({failure}); stk-train tries again when it needs it")


if __name__ == "__main__":
    main()
