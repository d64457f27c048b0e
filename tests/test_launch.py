"""stk-launch: the allocation, hostfile, environment and commands it works out (--dry-run, from a
Slurm-like environment), signal forwarding and exit codes, and real runs of stk-train through
DeepSpeed's MPI launcher (MPICH) on this machine."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import REPO, train_env

from stk.cli.launch import RANK_ENTRY
from stk.errors import ExitCode, InputError
from stk.launch.allocation import Allocation, read_allocation
from stk.launch.status import job_exit_code
from stk.launch.supervise import supervise
from stk.models import Family
from stk.slurm import hostnames

STK_LAUNCH = str(REPO / "bin" / "stk-launch")
SLURM = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "123"}
FAST = ["--batch-size", "1", "--lr", "1e-3", "--precision", "fp32", "-q"]


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """train_env() (no Slurm, MPI or STK_ variables) plus `extra`."""
    return {**train_env(), **(extra or {})}


def stk_launch(
    args: list[object], env: dict[str, str], timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STK_LAUNCH, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd
    )


def dry_run(args: list[object], env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The variables and the command that `stk-launch --dry-run` prints."""
    proc = stk_launch(["--dry-run", *args], env)
    assert proc.returncode == 0, proc.stderr
    *exports, command = proc.stdout.splitlines()
    variables = dict(line.removeprefix("export ").split("=", 1) for line in exports)
    return {k: shlex.split(v)[0] for k, v in variables.items()}, shlex.split(command)


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --- the allocation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slurm", "slots"),
    [
        ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "4"}, 8),
        ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
        ({"SLURM_GPUS_PER_NODE": "gpu:h100:4,gpu:a100:2"}, 6),
        ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ],
)
def test_slots_per_node_come_from_the_gpus_slurm_gives(slurm, slots):
    allocation = read_allocation({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7", **slurm})
    assert allocation == Allocation(("gpu01", "gpu02"), slots, "7")
    assert allocation.hostfile() == f"gpu01 slots={slots}\ngpu02 slots={slots}\n"
    assert read_allocation({"SLURM_JOB_NODELIST": "gpu01", **slurm}, slots=2).slots == 2  # the option wins


def test_outside_an_allocation_hosts_and_slots_must_be_given():
    assert read_allocation({}, "a,b", 2) == Allocation(("a", "b"), 2, None)
    with pytest.raises(InputError, match="not inside a Slurm allocation"):
        read_allocation({})
    with pytest.raises(InputError, match="give --slots-per-node"):
        read_allocation({}, "a,b")
    with pytest.raises(InputError, match="names a host twice"):
        read_allocation({}, "a,a", 1)


def test_node_list_is_expanded_without_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol needed
    assert hostnames("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]


# --- what it would run: --dry-run ---------------------------------------------------------------------------------


def test_dry_run_in_a_slurm_job_writes_the_hostfile_and_prints_environment_and_deepspeed_command(tmp_path):
    config = tmp_path / "stk.toml"
    config.write_text('[launch]\nnccl-socket-ifname = "ib0"\nnccl-ib-hca = "mlx5_0"\ngloo-socket-ifname = "eth0"\n'
                      'mpi-impl = "mpich"\n')  # fmt: skip
    hostfile = tmp_path / "hosts"
    env = launch_env({**SLURM, "NCCL_DEBUG": "WARN", "HDF5_USE_FILE_LOCKING": "TRUE"})
    variables, command = dry_run(
        ["--config", config, "--nccl-ib-hca", "mlx5_1:1", "--hostfile", hostfile, "--", "--cache", "C", "-q"], env
    )
    assert hostfile.read_text() == "gpu01 slots=8\ngpu02 slots=8\n"
    assert variables["STK_MASTER_ADDR"] == "gpu01" and variables["STK_MASTER_PORT"] == str(20000 + 123)
    assert variables["NCCL_SOCKET_IFNAME"] == "ib0" and variables["GLOO_SOCKET_IFNAME"] == "eth0"  # from [launch]
    assert variables["NCCL_IB_HCA"] == "mlx5_1:1"  # the option beats the config
    assert variables["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert variables["HDF5_USE_FILE_LOCKING"] == "TRUE"  # already set: kept
    assert command[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert option(command, "--hostfile") == str(hostfile) and option(command, "--launcher") == "mpich"
    assert option(command, "--master_addr") == "gpu01" and option(command, "--master_port") == "20123"
    assert "--no_ssh_check" in command and "--force_multi" not in command  # two hosts: multi-node anyway
    assert "--launcher_args=-genvall" in command
    assert command[-4:] == [RANK_ENTRY.script, "--cache", "C", "-q"]  # stk-train's arguments unchanged, at the end


def test_dry_run_for_one_host_with_openmpi_names_what_mpirun_must_pass(tmp_path):
    env = launch_env({"AWS_SECRET_ACCESS_KEY": "s3cr3t", "STK_TRAIN_MAX_STEPS": "9", "NCCL_IB_HCA": "mlx5_2"})
    variables, command = dry_run(
        ["--hosts", "node7", "--slots-per-node", "4", "--mpi-impl", "openmpi", "--master-port", "29999",
         "--nccl-socket-ifname", "eth1", "--gloo-socket-ifname", "eth1", "--hostfile", tmp_path / "h", "--cache", "C"],
        env,
    )  # fmt: skip
    assert (tmp_path / "h").read_text() == "node7 slots=4\n"
    assert variables["STK_MASTER_ADDR"] == "node7" and variables["STK_MASTER_PORT"] == "29999"
    assert variables["NCCL_IB_HCA"] == "mlx5_2"  # no option: the environment's value is kept
    assert "--force_multi" in command  # one host: DeepSpeed would start the ranks itself, without MPI
    launcher_args = next(a for a in command if a.startswith("--launcher_args=")).split()
    for name in ("STK_MASTER_ADDR", "STK_MASTER_PORT", "STK_TRAIN_MAX_STEPS", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
                 "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HDF5_USE_FILE_LOCKING",
                 "AWS_SECRET_ACCESS_KEY"):  # fmt: skip
        assert name in launcher_args
    assert "eth1" in launcher_args  # btl_tcp_if_include, instead of DeepSpeed's eth0
    assert not any("s3cr3t" in arg for arg in command)  # names only: no value in argv
    assert command[-2:] == ["--cache", "C"]  # no `--`: the first unknown option starts stk-train's arguments


def test_dry_run_via_srun(tmp_path):
    env = launch_env({**SLURM, "SLURM_CPUS_PER_TASK": "8", "STK_LAUNCH_VIA": "srun", "STK_LAUNCH_MPI": "pmix"})
    variables, command = dry_run(["stk-train", "--cache", "C"], env)
    assert variables["STK_MASTER_ADDR"] == "gpu01"
    assert command == [
        "srun", "--mpi=pmix", "--nodes=2", "--ntasks-per-node=8", "--ntasks=16", "--cpus-per-task=8",
        sys.executable, "-m", "stk.cli.train", "--cache", "C",
    ]  # fmt: skip


def test_outside_an_allocation_it_fails_with_one_line():
    proc = stk_launch(["--", "--cache", "C"], launch_env())
    assert proc.returncode == ExitCode.INPUT and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not inside a Slurm allocation (SLURM_JOB_NODELIST is unset)" in lines[0], lines


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


def test_supervise_returns_128_plus_the_signal_that_killed_the_launcher():
    assert supervise([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {}) == 137


# --- real runs through DeepSpeed's MPI launcher (MPICH from pip) ---------------------------------------------------


def metrics(out: Path) -> list[dict[str, object]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def local_launch(model: str, cache: Path, out: Path, hostfile: Path, *extra: str) -> list[str]:
    return [
        "--hosts", "localhost", "--slots-per-node", "2", "--master-addr", "127.0.0.1", "--hostfile", str(hostfile),
        "--", "--cache", str(cache), "--model", model, "--output-dir", str(out), *FAST, *extra,
    ]  # fmt: skip


@pytest.mark.integration
def test_in_a_slurm_job_the_hosts_come_from_slurm_and_sigusr2_reaches_ranks_started_through_srun(
    slurm_cluster, setups, tmp_path
):
    """The way train.sbatch runs it: stk-launch in the batch script of a real (one-node) Slurm job.
    MPICH's mpirun then starts the ranks through srun, outside stk-launch's process tree."""
    model, cache = setups(Family.SD)
    out, hostfile = tmp_path / "run", tmp_path / "hosts"
    train = ["--cache", cache, "--model", model, "--output-dir", out, *FAST, "--epochs", 50, "--checkpoint-every", 0]
    extensions = train_env()["TORCH_EXTENSIONS_DIR"]
    script = f"""#!/bin/bash
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR={shlex.quote(extensions)}
{shlex.quote(STK_LAUNCH)} --hostfile {shlex.quote(str(hostfile))} -- {shlex.join(map(str, train))} > {tmp_path}/stdout &
launcher=$!
for _ in $(seq 900); do [ "$(wc -l < {out}/metrics.jsonl 2>/dev/null)" -ge 2 ] 2>/dev/null && break; sleep 0.2; done
kill -USR2 $launcher
wait $launcher
echo "stk-launch exited $?"
"""
    job = slurm_cluster.submit(script, options=["-N1", "-n2", "-c1", "--gpus-per-node=2"], timeout=240)
    log = slurm_cluster.output(job)
    assert "stk-launch exited 75" in log, log
    assert hostfile.read_text() == f"{slurm_cluster.node} slots=2\n"  # SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE
    assert "asking 2 rank(s) on this node to checkpoint" in log and "Traceback" not in log, log
    assert json.loads((tmp_path / "stdout").read_text())["outcome"] == "requeue"
    assert (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()).is_dir()
