"""One rank's failure is everyone's, at once, with its reason: a fault on rank 1 alone (another
setting, an unreadable model, a rank SIGKILLed, SIGSTOPped, or its sockets reset) ends the whole
job within a bounded time, with the reason logged once and naming the rank and host, under
mpiexec, `srun --mpi=pmi2` (without --kill-on-bad-exit) and stk-launch. A rerun then completes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.commands import CACHE, MPIEXEC, SCAN, STK_LAUNCH, TRAIN, cache_env, scan_env, summary_of, train_env
from support.processes import descendant_pids, process_ended

from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration

HOST = socket.gethostname()
TIMEOUT_S = 8  # --collective-timeout in these tests: the wait of the two tests that stop a rank
PEER = "a peer rank failed, stopped answering or was cut off"
STEPS = 20  # long enough that every fault, applied after step 3, lands mid-run
TRAIN_ARGS = ["--batch-size", "1", "--lr", "1e-3", "--precision", "fp32", "-q", "--collective-timeout", TIMEOUT_S]


def mpmd(
    command: Sequence[object], rank1_env: dict[str, str] | None = None, rank1_args: Sequence[object] = ()
) -> list[str]:
    """`mpiexec -n 1 CMD : -n 1 env X=Y CMD ARGS`: rank 1 alone gets another environment or arguments."""
    rank1 = ["env", *(f"{k}={v}" for k, v in (rank1_env or {}).items()), *command, *rank1_args]
    return [str(MPIEXEC), "-n", "1", *map(str, command), ":", "-n", "1", *map(str, rank1)]


def timed(command: Sequence[object], env: dict[str, str], timeout: float = 240) -> tuple[Any, float]:
    started = time.monotonic()
    proc = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=env, timeout=timeout)
    seconds = time.monotonic() - started
    print(f"exit {proc.returncode} after {seconds:.1f} s")  # the fault table's figures (pytest -rP)
    return proc, seconds


def errors(stderr: str) -> list[str]:
    """stk's ERROR lines (what a person reads at the end of a job log)."""
    return [line for line in stderr.splitlines() if re.search(r" stk-\w+ r\d+@\S+ ERROR ", line)]


def assert_reason(stderr: str, logged_by: int, rank: int, text: str) -> None:
    """One ERROR line, logged by rank `logged_by`, naming rank `rank` and its host, saying `text`;
    no traceback and no "a bug"."""
    lines = errors(stderr)
    assert len(lines) == 1, stderr[-4000:]
    assert f" r{logged_by}@{HOST} ERROR rank {rank} on {HOST}: " in lines[0] and text in lines[0], lines[0]
    assert "Traceback" not in stderr and "a bug" not in stderr, stderr[-4000:]


def metrics(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


# --- a fault on rank 1 alone, from the start -------------------------------------------------------------------------


def test_scan_setting_bad_on_rank_1_alone_ends_the_job_with_its_reason(dataset, tmp_path):
    """Rank 1 alone reads another --max-errors (its node's environment): before, it exited without
    a word and rank 0 waited for it forever."""
    root, _ = dataset
    scan = [*SCAN, root, "--out", tmp_path / "scan", "--batch-size", "1", "--gpus", "1"]
    proc, seconds = timed(mpmd(scan, {"STK_SCAN_MAX_ERRORS": "lots"}), scan_env(), timeout=120)
    assert proc.returncode == ExitCode.INPUT, proc.stderr
    assert seconds < 60
    assert_reason(proc.stderr, 1, 1, "--max-errors 'lots': give a count (100) or a percentage (1%) (stopping all 2")
    rerun, _ = timed([MPIEXEC, "-n", "2", *scan], scan_env(), timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert summary_of(rerun)["ranks"] == 2 and summary_of(rerun)["files"] > 0


def test_cache_model_unreadable_on_rank_1_is_reported_once_naming_rank_1(setups, scan, tmp_path):
    """The model loads on every rank together (World.run_everywhere): every rank ends by itself with
    the code, and rank 0 logs rank 1's reason once."""
    model, _ = setups(Family.SD)
    cache = tmp_path / "cache"
    build = [*CACHE, scan, "--model", model, "--out", cache, "--dtype", "float32", "-q"]
    missing = tmp_path / "not-mounted" / "model"
    proc, seconds = timed(mpmd(build, rank1_args=["--model", missing]), cache_env())
    assert proc.returncode == ExitCode.INPUT, proc.stderr
    assert seconds < 120
    assert_reason(proc.stderr, 0, 1, str(missing))
    rerun, _ = timed([MPIEXEC, "-n", "2", *build], cache_env())
    assert rerun.returncode == 0, rerun.stderr
    verify, _ = timed([*CACHE, "verify", cache, "--scan", scan], cache_env())
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_train_config_missing_on_rank_1_alone_ends_the_job_and_the_rerun_trains(setups, scan, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    train = [*TRAIN, "--cache", cache, "--scan", scan, "--model", model, "--output-dir", out, *TRAIN_ARGS]
    train += ["--max-steps", 4]
    missing = tmp_path / "node-local" / "ds.json"
    proc, seconds = timed(mpmd(train, rank1_args=["--deepspeed", missing]), train_env())
    assert proc.returncode == ExitCode.INPUT, proc.stderr
    assert seconds < 120
    assert_reason(proc.stderr, 1, 1, f"--deepspeed {missing}: No such file or directory")
    rerun, _ = timed([MPIEXEC, "-n", "2", *train], train_env())
    assert rerun.returncode == 0, rerun.stderr
    assert metrics(out) == [1, 2, 3, 4]


# --- a rank killed, stopped or cut off mid-training ------------------------------------------------------------------


def rank_pid(rank: int, marker: str, below: int | None = None) -> int | None:
    """The pid of MPI rank `rank` whose command line holds `marker` (the run's output dir), among
    the descendants of `below` (mpiexec, stk-launch) or anywhere (srun's tasks run under slurmstepd).
    DeepSpeed's launcher helper, which holds the same arguments, is not the rank."""
    pids = descendant_pids(below) if below is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() not in cmdline or any(b"mpiexec" in p or b"launcher" in p for p in cmdline[:3]):
            continue
        if f"PMI_RANK={rank}".encode() in environ:
            return pid
    return None


def reset_sockets(pid: int, peer: int) -> int:
    """Reset (`ss -K`: the kernel aborts it, the peer reads ECONNRESET) every TCP connection between
    the two processes, as a failing switch or NIC would; how many."""
    listing = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True)
    owned: dict[str, int] = {}
    pairs: list[tuple[str, str, int]] = []
    for line in listing.stdout.splitlines():
        fields = line.split()
        found = re.search(r"pid=(\d+),", line)
        if len(fields) >= 4 and found:
            owned[fields[2]] = int(found[1])
            pairs.append((fields[2], fields[3], int(found[1])))
    links = [(local, remote) for local, remote, owner in pairs if owner == pid and owned.get(remote) == peer]
    for local, remote in links:
        subprocess.run(["ss", "-K", "-t", "src", local, "dst", remote], capture_output=True, check=True)
    return len(links)


def train_args(model: str, cache: Path, out: Path) -> list[object]:
    return [
        "--cache",
        cache,
        "--model",
        model,
        "--output-dir",
        out,
        *TRAIN_ARGS,
        "--epochs",
        50,
        "--max-steps",
        STEPS,
        "--checkpoint-every",
        5,
    ]


def fault_mid_training(
    command: Sequence[object], env: dict[str, str], out: Path, fault: Callable[[subprocess.Popen[str]], None]
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Start the run, apply `fault` once 3 steps are in metrics.jsonl; the ended run and the
    seconds from the fault to its end."""
    proc = subprocess.Popen(
        list(map(str, command)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(metrics(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(metrics(out)) >= 3 and proc.poll() is None, "training did not start"
        fault(proc)
        faulted = time.monotonic()
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S + 90)
        seconds = time.monotonic() - faulted
        print(f"exit {proc.returncode} {seconds:.1f} s after the fault")  # the fault table's figures (pytest -rP)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), seconds
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def signal_rank(rank: int, sig: int, marker: str, below_launcher: bool = True) -> Callable[[Any], None]:
    def fault(proc: subprocess.Popen[str]) -> None:
        pid = rank_pid(rank, marker, proc.pid if below_launcher else None)
        assert pid is not None, f"rank {rank} not found"
        os.kill(pid, sig)

    return fault


def reset_rank_1(marker: str) -> Callable[[Any], None]:
    def fault(proc: subprocess.Popen[str]) -> None:
        victim, peer = rank_pid(1, marker, proc.pid), rank_pid(0, marker, proc.pid)
        assert victim is not None and peer is not None
        assert reset_sockets(victim, peer) > 0, "no TCP connection between the ranks"

    return fault


def assert_rerun_completes(command: Sequence[object], env: dict[str, str], out: Path) -> None:
    rerun, _ = timed(command, env)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert summary_of(rerun)["steps"] == STEPS
    assert metrics(out) == list(range(1, STEPS + 1))  # each step once: the failed run's extra steps dropped


FAULTS = {
    # hydra itself ends the job when a rank dies of a signal, with that signal's number
    "sigkill": (signal.SIGKILL, (9, 137), None),
    "sigstop": (signal.SIGSTOP, (ExitCode.INFRA,), (f"no answer within --collective-timeout {TIMEOUT_S} s",)),
    # reset by peer (rank 0), connection abort (rank 1): whichever rank reports first aborts the job
    "reset": (None, (ExitCode.INFRA,), ("Read error", "Software caused connection abort")),
}


@pytest.mark.parametrize("name", FAULTS)
def test_train_rank_1_killed_stopped_or_reset_under_mpiexec_ends_the_job(name, setups, tmp_path):
    sig, codes, reasons = FAULTS[name]
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    command = [MPIEXEC, "-n", 2, *TRAIN, *train_args(model, cache, out)]
    fault = reset_rank_1(str(out)) if sig is None else signal_rank(1, sig, str(out))
    proc, seconds = fault_mid_training(command, train_env(), out, fault)
    assert proc.returncode in codes, proc.stderr[-4000:]
    assert seconds < TIMEOUT_S + 45
    if reasons:  # from each rank that saw it before the abort: after a reset, both may
        lines, host = errors(proc.stderr), re.escape(HOST)
        assert lines and all(re.search(rf" r(\d)@{host} ERROR rank \1 on {host}: {PEER}", line) for line in lines)
        assert any(reason in line for line in lines for reason in reasons), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "a bug" not in proc.stderr, proc.stderr[-4000:]
    if name == "sigkill":  # the others leave the same checkpoints behind; one rerun proves the resume
        assert_rerun_completes(command, train_env(), out)


def test_train_rank_1_killed_under_srun_without_kill_on_bad_exit_ends_the_step(slurm_cluster, setups, tmp_path):
    """srun waits for every task unless --kill-on-bad-exit: rank 0 sees its peer's socket close,
    says so and aborts; Slurm then cancels the step, and srun exits 137 whatever the code."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    env = {**train_env(), "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    command = ["timeout", 300, "srun", "--mpi=pmi2", "-n", 2, "-c", 1, *TRAIN, *train_args(model, cache, out)]
    fault = signal_rank(1, signal.SIGKILL, str(out), below_launcher=False)
    proc, seconds = fault_mid_training(command, env, out, fault)
    assert proc.returncode == 137, proc.stderr[-4000:]
    assert seconds < TIMEOUT_S + 45
    assert_reason(proc.stderr, 0, 0, PEER)
    assert "MPI_Abort(MPI_COMM_WORLD, 69)" in proc.stderr
    assert_rerun_completes(command, env, out)


def test_stk_launch_returns_69_when_a_rank_stops_answering_and_leaves_no_rank_behind(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    command = [
        STK_LAUNCH,
        "--hosts",
        "localhost",
        "--slots-per-node",
        2,
        "--master-addr",
        "127.0.0.1",
        "--hostfile",
        tmp_path / "hosts",
        "--",
        *train_args(model, cache, out),
    ]
    stopped: list[int] = []

    def stop_rank_1(proc: subprocess.Popen[str]) -> None:
        pid = rank_pid(1, str(out), proc.pid)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    proc, seconds = fault_mid_training(command, train_env(), out, stop_rank_1)
    assert (tmp_path / "hosts").read_text() == "localhost slots=2\n"
    assert proc.returncode == ExitCode.INFRA, proc.stderr[-4000:]  # DeepSpeed's launcher itself returns 0
    assert seconds < TIMEOUT_S + 45
    assert_reason(proc.stderr, 0, 0, f"no answer within --collective-timeout {TIMEOUT_S} s")
    assert process_ended(stopped[0], 10), "the stopped rank was left behind"
