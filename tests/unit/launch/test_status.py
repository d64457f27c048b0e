"""stk.launch.status: the job's exit code from its ranks', and signals forwarded to the registered ranks."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stk.errors import ExitCode
from stk.launch.status import job_exit_code

# --- signals and exit codes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("launcher", "ranks", "job"),
    [
        (0, [75, 75], 75),  # DeepSpeed's mpich helper returned 0 for ranks that checkpointed
        (0, [76, 76], 76),
        (0, [0, 0], 0),
        (0, [3, 3], 3),
        (79, [75, 76], 76),  # mpiexec ORs different codes
        (0, [None, 75], 69),  # a rank was killed: a peer or its node was lost, a rerun resumes
        (137, [None, None], 69),
        (0, [], 0),  # no rank on this node: the launcher's code
        (5, [], 5),
    ],
)
def test_the_job_code_comes_from_the_ranks(launcher, ranks, job):
    assert job_exit_code(launcher, ranks) == job


FAKE_RANK = """
import pathlib, signal, sys, time
from stk.launch.status import run_rank

def main(args, prog_name):
    signal.signal(signal.SIGUSR2, lambda *_: sys.exit(75))  # what stk-train does: checkpoint, exit 75
    pathlib.Path(args[0]).touch()
    time.sleep(30)
    sys.exit(1)

sys.exit(run_rank(sys.argv[1:], main))
"""


def signal_when_ready(proc: subprocess.Popen[str], ready: Path, sig: signal.Signals) -> tuple[str, str]:
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ready.exists(), "the rank did not start"
    proc.send_signal(sig)
    return proc.communicate(timeout=20)


def test_sigterm_reaches_the_registered_ranks_and_their_code_beats_the_launchers(tmp_path):
    """Like DeepSpeed's mpich launcher: the rank runs in a new session (not found by walking the
    process tree, as under srun) below a launcher that exits 0 whatever the rank returned."""
    ready = tmp_path / "ready"
    launcher = f"setsid {shlex.quote(sys.executable)} -c {shlex.quote(FAKE_RANK)} {ready}; exit 0"
    code = "import sys; from stk.launch.supervise import run_ranks; sys.exit(run_ranks(['sh', '-c', sys.argv[1]], {})) "
    proc = subprocess.Popen([sys.executable, "-c", code, launcher], stderr=subprocess.PIPE, text=True)
    _, stderr = signal_when_ready(proc, ready, signal.SIGTERM)
    assert proc.returncode == ExitCode.REQUEUE, stderr
    assert "SIGTERM received: asking 1 rank(s) on this node to checkpoint (SIGUSR2)" in stderr


def test_sigusr2_goes_to_srun_itself(tmp_path):
    """srun passes SIGUSR2 on to every task; here a child that answers it with 75."""
    ready = tmp_path / "ready"
    code = "import json, sys; from stk.launch import supervise as s; sys.exit(s.supervise(json.loads(sys.argv[1]), {}))"
    child = json.dumps([sys.executable, "-c", FAKE_RANK, str(ready)])
    proc = subprocess.Popen([sys.executable, "-c", code, child], stderr=subprocess.PIPE, text=True)
    _, stderr = signal_when_ready(proc, ready, signal.SIGUSR2)
    assert proc.returncode == ExitCode.REQUEUE, stderr
