"""What stk-launch runs: the command, the variables set for it, and the hostfile, worked out from
the options and the allocation before anything starts (so --dry-run can print it)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stk.cluster import slurm
from stk.errors import InputError
from stk.launch.allocation import Allocation

__all__ = [
    "MPI_IMPLS",
    "VIAS",
    "Launch",
    "LaunchSettings",
    "RankEntry",
    "detect_mpi_impl",
    "plan_launch",
]

VIAS = ("deepspeed", "srun")
MPI_IMPLS = ("mpich", "openmpi")
# What OpenMPI's mpirun must pass to the ranks by name (MPICH's passes everything).
FORWARDED_PREFIXES = ("STK_", "NCCL_", "GLOO_", "TORCH_", "HDF5_", "DS_", "OMP_", "HF_", "AWS_")


@dataclass(frozen=True)
class RankEntry:
    """What each rank runs, named by the command layer: DeepSpeed's MPI launcher runs `script` (a
    path, see stk.launch), srun runs stk-train's `module` with `python -m`."""

    script: str
    module: str


@dataclass(frozen=True)
class LaunchSettings:
    """stk-launch's options; None means "work it out" (see plan_launch)."""

    via: str = "deepspeed"  # one of VIAS
    mpi: str = "pmi2"  # srun's MPI plugin
    mpi_impl: str | None = None  # DeepSpeed's --launcher: mpich or openmpi
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nccl_socket_ifname: str | None = None
    nccl_ib_hca: str | None = None
    gloo_socket_ifname: str | None = None
    s3_endpoint_url: str | None = None
    s3_retry_seconds: float | None = None
    hosts_given: bool = False  # --hosts chose the hosts: srun gets --nodelist


@dataclass(frozen=True)
class Launch:
    """One launch, worked out: the command, the variables set for it, and the hostfile."""

    via: str
    command: list[str]
    env: dict[str, str]  # set (or kept) on top of stk-launch's own environment
    allocation: Allocation
    hostfile: str | None  # where the hostfile goes (DeepSpeed only)

    def script(self) -> str:
        """What --dry-run prints: a shell script that makes the same launch."""
        lines = [f"export {name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        return "\n".join([*lines, shlex.join(self.command)]) + "\n"


def plan_launch(
    settings: LaunchSettings,
    allocation: Allocation,
    train_args: Sequence[str],
    environ: Mapping[str, str],
    entry: RankEntry,
) -> Launch:
    """The whole launch, decided before anything runs, so that --dry-run prints exactly what a
    real run would do: the ranks' variables, then srun or DeepSpeed's runner with the MPI that
    mpi4py uses (its mpirun first on PATH when pip installed it beside this python)."""
    env = launch_environment(settings, allocation, environ)
    if settings.via == "srun":
        command = srun_command(settings, allocation, train_args, environ, entry.module)
        return Launch("srun", command, env, allocation, None)
    if settings.via != "deepspeed":
        raise InputError(f"--via {settings.via!r}: choose one of {', '.join(VIAS)}")
    impl = settings.mpi_impl or detect_mpi_impl()
    if impl not in MPI_IMPLS:
        raise InputError(f"--mpi-impl {impl!r}: choose one of {', '.join(MPI_IMPLS)}")
    hostfile = settings.hostfile or default_hostfile(allocation.job_id)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    path = environ.get("PATH", os.defpath)
    if os.path.exists(mpirun) and shutil.which("mpirun", path=path) != mpirun:
        # the MPI installed beside this python (pip's mpich) is the one mpi4py loads: its mpirun first
        env["PATH"] = f"{os.path.dirname(mpirun)}{os.pathsep}{path}"
    command = deepspeed_command(impl, hostfile, allocation, {**environ, **env}, [entry.script, *train_args])
    return Launch("deepspeed", command, env, allocation, hostfile)


def launch_environment(settings: LaunchSettings, allocation: Allocation, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every rank needs: the rendezvous stk-train's rank 0 uses, NCCL's behaviour
    on a dead peer, HDF5 without file locks (NFS, Lustre), the NCCL and gloo interfaces. A value already in
    the environment is kept unless an option sets it."""
    env = {
        "STK_MASTER_ADDR": settings.master_addr or environ.get("STK_MASTER_ADDR") or allocation.hosts[0],
        "STK_MASTER_PORT": str(settings.master_port or environ.get("STK_MASTER_PORT") or default_port(allocation)),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "HDF5_USE_FILE_LOCKING": environ.get("HDF5_USE_FILE_LOCKING", "FALSE"),
    }
    interfaces = (
        ("NCCL_SOCKET_IFNAME", settings.nccl_socket_ifname),
        ("NCCL_IB_HCA", settings.nccl_ib_hca),
        ("GLOO_SOCKET_IFNAME", settings.gloo_socket_ifname),
    )
    for name, value in interfaces:
        if value or environ.get(name):
            env[name] = value or environ[name]
    if settings.s3_endpoint_url and "STK_TRAIN_S3_ENDPOINT_URL" not in environ:
        env["STK_TRAIN_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    if settings.s3_retry_seconds is not None and "STK_TRAIN_S3_RETRY_SECONDS" not in environ:
        env["STK_TRAIN_S3_RETRY_SECONDS"] = f"{settings.s3_retry_seconds:g}"
    return env


def default_port(allocation: Allocation) -> int:
    """The job's port (the same on every node and after a requeue); outside Slurm, one free here now."""
    if allocation.job_id and allocation.job_id.isdigit():
        return slurm.job_port(int(allocation.job_id))
    return slurm.free_port()


def default_hostfile(job_id: str | None) -> str:
    """$TMPDIR/stk-hostfile-JOBID on the batch host, where DeepSpeed's launcher reads it."""
    tag = job_id or f"pid{os.getpid()}"
    return os.path.join(tempfile.gettempdir(), f"stk-hostfile-{tag}")


def deepspeed_command(
    impl: str, hostfile: str, allocation: Allocation, env: Mapping[str, str], rank_command: Sequence[str]
) -> list[str]:
    """DeepSpeed's runner with its MPI launcher, given the environment it will get; one host needs
    --force_multi or it starts the ranks itself without MPI. Each rank runs `rank_command` (the
    rank script and stk-train's arguments, see stk.launch)."""
    if impl == "mpich":
        launcher_args = ["-genvall"]
    else:
        names = sorted(n for n in env if n.startswith(FORWARDED_PREFIXES) and not n.startswith("STK_LAUNCH_"))
        launcher_args = [arg for name in names for arg in ("-x", name)]
        ifname = env.get("NCCL_SOCKET_IFNAME", "")
        if re.fullmatch(r"[\w.-]+(,[\w.-]+)*", ifname):  # a plain list; NCCL's ^ and = prefixes mean nothing to MPI
            launcher_args += ["--mca", "btl_tcp_if_include", ifname]  # replaces DeepSpeed's default: eth0
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        hostfile,
        "--launcher",
        impl,
        "--master_addr",
        env["STK_MASTER_ADDR"],
        "--master_port",
        env["STK_MASTER_PORT"],
        "--no_ssh_check",
        "--log_level",
        "warning",
        f"--launcher_args={shlex.join(launcher_args)}",
    ]
    if len(allocation.hosts) == 1:
        command.append("--force_multi")
    return [*command, *rank_command]


def srun_command(
    settings: LaunchSettings,
    allocation: Allocation,
    train_args: Sequence[str],
    environ: Mapping[str, str],
    train_module: str,
) -> list[str]:
    """One srun step with a task per slot; srun passes the environment and signals to every task."""
    command = [
        "srun",
        f"--mpi={settings.mpi}",
        f"--nodes={len(allocation.hosts)}",
        f"--ntasks-per-node={allocation.slots}",
        f"--ntasks={len(allocation.hosts) * allocation.slots}",
    ]
    cpus = slurm.cpus_per_task(environ)
    if cpus:
        command.append(f"--cpus-per-task={cpus}")
    if settings.hosts_given:
        command.append(f"--nodelist={','.join(allocation.hosts)}")
    return [*command, sys.executable, "-m", train_module, *train_args]


def detect_mpi_impl() -> str:
    """mpich or openmpi, from the library mpi4py loads (read without initialising MPI)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # this process is no rank: never MPI_Init here
        from mpi4py import MPI

        version = MPI.Get_library_version()
    except (ImportError, RuntimeError) as exc:
        raise InputError(f"cannot tell which MPI mpi4py uses ({exc}): give --mpi-impl mpich|openmpi") from exc
    # Intel MPI, MVAPICH and Cray MPICH derive from MPICH: their mpirun takes MPICH's options
    return "openmpi" if "open mpi" in version.lower() else "mpich"
