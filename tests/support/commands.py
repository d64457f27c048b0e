"""How the tests run each command as users run it: a subprocess, alone or under mpiexec, in a clean
environment (or click's CliRunner in-process), and what it printed."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stk.cluster.lease import lease_name
from support.weed_server import S3_ENV

REPO = Path(__file__).resolve().parents[2]  # the checkout: its bin/, etc/, sbatch/ and bench/
BIN = Path(sys.executable).parent
STK_LAUNCH = str(REPO / "bin" / "stk-launch")
MPIEXEC = BIN / "mpiexec"
SCAN = [sys.executable, "-m", "stk.cli.scan"]
EXPORT = [sys.executable, "-m", "stk.cli.export"]

RunScan = Callable[..., "subprocess.CompletedProcess[str]"]
Mount = Callable[[str, str], Path]


def scan_env() -> dict[str, str]:
    """The environment for a scan subprocess: no stray STK_/AWS_ settings, and no Slurm or MPI
    variables (they would change the GPU count, or make a plain run think it is a rank). STK_PYTHON stays:
    it names the venv under test to the checkout's bin/ scripts (make test sets it)."""
    dropped = ("STK_", "AWS_", "SLURM_", "PMI_", "PMIX_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped) or k == "STK_PYTHON"}
    env.pop("MPI_LOCALNRANKS", None)
    env.update(S3_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def scan_command(args: list[str], mpi: int = 0) -> list[str]:
    command = [*SCAN, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


def summary_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one JSON summary line stk-scan prints on stdout."""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one summary line on stdout, got {proc.stdout!r}; stderr:\n{proc.stderr}"
    summary: dict[str, Any] = json.loads(lines[0])
    return summary


CACHE = [sys.executable, "-m", "stk.cli.cache"]


def cache_env() -> dict[str, str]:
    """scan_env() with one torch thread per process. CPU results are bitwise equal across rank counts only at equal
    threads per rank: under mpiexec, Intel's OpenMP divides the cores among the node's ranks (MPI_LOCALNRANKS), and
    oneDNN's convolutions sum in another order with another thread count."""
    env = scan_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


def cache_command(args: list[Any], mpi: int = 0) -> list[str]:
    """stk-cache as users run it, alone or under `mpiexec -n MPI` (same clean env: scan_env())."""
    command = [*CACHE, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


def clean_env(**extra: str) -> dict[str, str | None]:
    """An environment for CliRunner: no STK_ settings, no Slurm or MPI launcher from the caller."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("STK_", "SLURM_"))}
    for name in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        env[name] = None
    env.update(extra)
    return env


TRAIN = [sys.executable, "-m", "stk.cli.train"]
# DeepSpeed's ops build into a fresh directory per test session, as on a fresh machine, so every session takes
# the cold path: its first training run builds the shared-memory op (~60 s on 2 cores), its first offloaded one
# CPU Adam (~85 s). fixtures.py removes it at the end. TORCH_EXTENSIONS_DIR set for pytest keeps builds instead.
FRESH_EXTENSIONS_DIR = not os.environ.get("TORCH_EXTENSIONS_DIR")
EXTENSIONS_DIR = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or tempfile.mkdtemp(prefix="stk-torch-extensions-"))


def train_env() -> dict[str, str]:
    """scan_env() for DeepSpeed on the CPU: one torch thread per rank (bitwise-equal runs), the
    session's build directory for DeepSpeed's ops."""
    env = scan_env()
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    return env


def train_command(args: list[Any], mpi: int = 0) -> list[str]:
    """stk-train as users run it, alone or under `mpiexec -n MPI`."""
    command = [*TRAIN, *map(str, args)]
    return [str(MPIEXEC), "-n", str(mpi), *command] if mpi else command


FAST = ["--batch-size", "1", "--lr", "1e-3", "--precision", "fp32", "-q"]
LOUD = [a for a in FAST if a != "-q"]  # warnings shown (a skipped checkpoint is one)


def run_train(
    args: list[Any], mpi: int = 2, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """stk-train under `mpiexec -n MPI` (2 ranks unless told), finished, with no traceback."""
    full_env = train_env()
    full_env.update(env or {})
    proc = subprocess.run(train_command(args, mpi), capture_output=True, text=True, env=full_env, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


TRAIN_IMAGES = 24  # one 64x64 bucket (sides 64-80 px at alignment 64)


# stk-export that dies of SIGXFSZ at the file-size limit, as a process killed mid-write (Python ignores the signal)
KILLED_AT_LIMIT = (
    "import runpy, signal; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
    "runpy.run_module('stk.cli.export', run_name='__main__')"
)


def stk_export(*args: object, file_limit: int | None = None, killed: bool = False) -> subprocess.CompletedProcess[str]:
    """stk-export as users run it (one process, never under MPI); under a file-size limit (`ulimit -f`) of
    `file_limit` bytes where given: a write past it fails with EFBIG, or, `killed`, ends the process there."""
    command = [sys.executable, "-c", KILLED_AT_LIMIT] if killed else EXPORT
    limit = None if file_limit is None else (file_limit, file_limit)
    env = {**scan_env(), "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc written to meet the limit
    return subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limit),
    )


def one_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The run ended with `code` and exactly one ERROR line holding every needle, and no traceback."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(lines) == 1, proc.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


LEASE_NAME = lease_name("stk-train")
