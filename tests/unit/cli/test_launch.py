"""stk-launch --dry-run: the hostfile, environment and commands it works out from a Slurm-like environment, and the
one line outside an allocation."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from support.commands import STK_LAUNCH, train_env

from stk.cli.launch import RANK_ENTRY
from stk.errors import ExitCode

SLURM = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "123"}


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


# --- what it would run: --dry-run ---------------------------------------------------------------------------------


def test_dry_run_in_a_slurm_job_writes_the_hostfile_and_prints_environment_and_deepspeed_command(tmp_path):
    config = tmp_path / "stk.toml"
    config.write_text(
        '[launch]\nnccl-socket-ifname = "ib0"\nnccl-ib-hca = "mlx5_0"\ngloo-socket-ifname = "eth0"\n'
        'mpi-impl = "mpich"\n'
    )
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
        [
            "--hosts",
            "node7",
            "--slots-per-node",
            "4",
            "--mpi-impl",
            "openmpi",
            "--master-port",
            "29999",
            "--nccl-socket-ifname",
            "eth1",
            "--gloo-socket-ifname",
            "eth1",
            "--hostfile",
            tmp_path / "h",
            "--cache",
            "C",
        ],
        env,
    )
    assert (tmp_path / "h").read_text() == "node7 slots=4\n"
    assert variables["STK_MASTER_ADDR"] == "node7" and variables["STK_MASTER_PORT"] == "29999"
    assert variables["NCCL_IB_HCA"] == "mlx5_2"  # no option: the environment's value is kept
    assert "--force_multi" in command  # one host: DeepSpeed would start the ranks itself, without MPI
    launcher_args = next(a for a in command if a.startswith("--launcher_args=")).split()
    for name in (
        "STK_MASTER_ADDR",
        "STK_MASTER_PORT",
        "STK_TRAIN_MAX_STEPS",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "GLOO_SOCKET_IFNAME",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "HDF5_USE_FILE_LOCKING",
        "AWS_SECRET_ACCESS_KEY",
    ):
        assert name in launcher_args
    assert "eth1" in launcher_args  # btl_tcp_if_include, instead of DeepSpeed's eth0
    assert not any("s3cr3t" in arg for arg in command)  # names only: no value in argv
    assert command[-2:] == ["--cache", "C"]  # no `--`: the first unknown option starts stk-train's arguments


def test_dry_run_via_srun(tmp_path):
    env = launch_env({**SLURM, "SLURM_CPUS_PER_TASK": "8", "STK_LAUNCH_VIA": "srun", "STK_LAUNCH_MPI": "pmix"})
    variables, command = dry_run(["stk-train", "--cache", "C"], env)
    assert variables["STK_MASTER_ADDR"] == "gpu01"
    assert command == [
        "srun",
        "--mpi=pmix",
        "--nodes=2",
        "--ntasks-per-node=8",
        "--ntasks=16",
        "--cpus-per-task=8",
        sys.executable,
        "-m",
        "stk.cli.train",
        "--cache",
        "C",
    ]


def test_outside_an_allocation_it_fails_with_one_line():
    proc = stk_launch(["--", "--cache", "C"], launch_env())
    assert proc.returncode == ExitCode.INPUT and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not inside a Slurm allocation (SLURM_JOB_NODELIST is unset)" in lines[0], lines
