"""stk-launch: start stk-train on every GPU of a Slurm allocation, from the batch script.

It reads the allocation (hosts, GPUs per node), writes DeepSpeed's hostfile, picks the
rendezvous (the first host; a port derived from the job id) and the variables a multi-node run
needs, then runs DeepSpeed's MPI launcher (`--launcher mpich|openmpi`) or `srun --mpi=...` as
a child, forwards stop signals to the ranks and exits with the ranks' code.

What DeepSpeed 0.19.8 and MPICH 5 do, measured here, and what stk does about it:

- Exit codes. MPICH's `mpiexec` returns 75 when every rank exits 75, but ORs different codes
  (75 on one rank and 76 on another gives 79). DeepSpeed's `--launcher mpich` starts each rank
  through its `launcher_helper.py`, which waits for the rank and then exits 0 whatever the rank
  returned, so `deepspeed` exits 0 when all ranks exit 75 (requeue) or 3 (bad input). Its runner
  also exits 0 when mpirun dies of a signal. So each rank is started by `run_rank` (this file run
  as a script), which records the rank's exit code in a status directory on the launching node;
  stk-launch takes the job's code from the codes of the ranks on its node (stk-train's step
  agreement makes every rank end the same way) and uses the launcher's code only when no local
  rank left one. With `--launcher openmpi` (no helper) and srun (the highest task code) the codes
  come through anyway; the status files agree with them.
- `--module` is broken with `--launcher mpich` (the runner puts `-m` before the helper's path),
  which is the other reason ranks start as `python .../stk/launch.py ARGS`: that path must be
  the same on every node (a shared checkout or identical installs), as PYTHONPATH already is.
- Environment. MPICH's mpirun passes its whole environment to every rank (`-genvall`, made
  explicit); OpenMPI's passes only what `-x NAME` names, so stk-launch names the variables stk
  needs (STK_*, NCCL_*, TORCH_*, HDF5_*, DS_*, OMP_*, HF_*, AWS_*): by name only, so values
  (credentials) never appear in argv, and without the quoting DeepSpeed adds to the exports it
  writes itself (`.deepspeed_env` still works as DeepSpeed documents it).
- Signals. SIGUSR2 kills DeepSpeed's runner and its launcher helper (neither handles it), so a
  stop request never goes to the launcher. Inside an allocation MPICH's mpirun starts its
  proxies, and so the ranks, through srun: they run under slurmstepd, not below stk-launch, even
  on the batch host, so the process tree does not find them. Each rank registers instead (its
  status file is named HOST-PID), and SIGUSR2 or SIGTERM to stk-launch becomes SIGUSR2 to the
  registered ranks of this node, held until one of them handles it (SigCgt in /proc: a rank still
  importing torch would die of it); stk-train's step agreement tells the ranks on other nodes.
  With srun it goes to srun, which passes it to every task; srun exits with the highest task code.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from stk.errors import ExitCode, InputError
from stk.log import get_logger
from stk.storage import write_atomic
from stk.train.distributed import expand_nodelist
from stk.world import on_abort

__all__ = [
    "MPI_IMPLS",
    "VIAS",
    "Allocation",
    "Launch",
    "LaunchSettings",
    "RankStatus",
    "detect_mpi_impl",
    "execute",
    "job_exit_code",
    "plan_launch",
    "read_allocation",
    "read_ranks",
    "run_rank",
    "run_ranks",
    "slots_from_slurm",
    "slurm_hosts",
    "supervise",
]

log = get_logger("launch")

VIAS = ("deepspeed", "srun")
MPI_IMPLS = ("mpich", "openmpi")
TRAIN_MODULE = "stk.cli.train"
RANK_SCRIPT = os.path.abspath(__file__)  # each rank under DeepSpeed's launcher: `python RANK_SCRIPT ARGS`
RANK_STATUS_ENV = "STK_RANK_STATUS_DIR"
RUNNING = "running"
STOP_REQUESTS = (signal.SIGUSR2, signal.SIGTERM)
# What OpenMPI's mpirun must pass to the ranks by name (MPICH's passes everything).
FORWARDED_PREFIXES = ("STK_", "NCCL_", "TORCH_", "HDF5_", "DS_", "OMP_", "HF_", "AWS_")


# --- the allocation -------------------------------------------------------------------------


@dataclass(frozen=True)
class Allocation:
    """The hosts to run on, in rank order, with the same number of ranks (slots) on each."""

    hosts: tuple[str, ...]
    slots: int
    job_id: str | None = None

    def hostfile(self) -> str:
        """DeepSpeed's (and MPI's) hostfile: `host slots=N` per line."""
        return "".join(f"{host} slots={self.slots}\n" for host in self.hosts)


def read_allocation(environ: Mapping[str, str], hosts: str | None = None, slots: int | None = None) -> Allocation:
    """Hosts from `hosts` ("h1,h2") or the Slurm job's node list; slots from `slots` or the
    GPUs per node Slurm gives the job. Outside an allocation both must be given."""
    job_id = environ.get("SLURM_JOB_ID") or None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if hosts:
        names = tuple(h.strip() for h in hosts.split(",") if h.strip())
    elif nodelist:
        names = tuple(slurm_hosts(nodelist))
    else:
        raise InputError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST is unset): run stk-launch from an sbatch script "
            "or salloc, or give --hosts h1,h2 --slots-per-node N"
        )
    if not names:
        raise InputError(f"--hosts {hosts!r} names no host")
    if len(set(names)) != len(names):
        raise InputError(f"--hosts {hosts!r} names a host twice")
    slots = slots or slots_from_slurm(environ)
    if not slots:
        raise InputError(
            "cannot tell how many ranks to start per node: Slurm sets no GPU or task count "
            "(SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, SLURM_NTASKS_PER_NODE); give --slots-per-node N"
        )
    return Allocation(names, slots, job_id)


def slurm_hosts(nodelist: str) -> list[str]:
    """Host names of a Slurm node list, as `scontrol show hostnames` expands it; stk's own
    parser where scontrol is missing or cannot run (no slurm.conf)."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        )
        hosts = proc.stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("scontrol show hostnames failed (%s): reading the node list myself", exc)
        hosts = []
    return hosts or expand_nodelist(nodelist)


def slots_from_slurm(environ: Mapping[str, str]) -> int | None:
    """GPUs per node (SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE like "8" or "h100:8"),
    else tasks per node (SLURM_NTASKS_PER_NODE); None when Slurm says none of these."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        # "8", "h100:8", "gpu:h100:8"; "h100:4,a100:4" counts 8
        counts = [re.match(r"\d+", item.rsplit(":", 1)[-1]) for item in environ.get(name, "").split(",")]
        total = sum(int(m[0]) for m in counts if m)
        if total > 0:
            return total
    return None


# --- what to run --------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchSettings:
    """stk-launch's options; None means "work it out" (see plan_launch)."""

    via: str = "deepspeed"
    mpi: str = "pmi2"  # srun's MPI plugin
    mpi_impl: str | None = None  # DeepSpeed's --launcher: mpich or openmpi
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nccl_socket_ifname: str | None = None
    nccl_ib_hca: str | None = None
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
    settings: LaunchSettings, allocation: Allocation, train_args: Sequence[str], environ: Mapping[str, str]
) -> Launch:
    env = launch_environment(settings, allocation, environ)
    if settings.via == "srun":
        command = srun_command(settings, allocation, train_args, environ)
        return Launch("srun", command, env, allocation, None)
    if settings.via != "deepspeed":
        raise InputError(f"--via {settings.via!r}: choose one of {', '.join(VIAS)}")
    impl = settings.mpi_impl or detect_mpi_impl()
    if impl not in MPI_IMPLS:
        raise InputError(f"--mpi-impl {impl!r}: choose one of {', '.join(MPI_IMPLS)}")
    hostfile = settings.hostfile or default_hostfile(environ)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    path = environ.get("PATH", os.defpath)
    if os.path.exists(mpirun) and shutil.which("mpirun", path=path) != mpirun:
        # the MPI installed beside this python (pip's mpich) is the one mpi4py loads: its mpirun first
        env["PATH"] = f"{os.path.dirname(mpirun)}{os.pathsep}{path}"
    command = deepspeed_command(impl, hostfile, allocation, {**environ, **env}, train_args)
    return Launch("deepspeed", command, env, allocation, hostfile)


def launch_environment(settings: LaunchSettings, allocation: Allocation, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every rank needs: the rendezvous stk-train's rank 0 uses, NCCL's behaviour
    on a dead peer, HDF5 without file locks (NFS, Lustre), the NCCL interfaces. A value already in
    the environment is kept unless an option sets it."""
    env = {
        "STK_MASTER_ADDR": settings.master_addr or environ.get("STK_MASTER_ADDR") or allocation.hosts[0],
        "STK_MASTER_PORT": str(settings.master_port or environ.get("STK_MASTER_PORT") or default_port(allocation)),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "HDF5_USE_FILE_LOCKING": environ.get("HDF5_USE_FILE_LOCKING", "FALSE"),
    }
    for name, value in (("NCCL_SOCKET_IFNAME", settings.nccl_socket_ifname), ("NCCL_IB_HCA", settings.nccl_ib_hca)):
        if value or environ.get(name):
            env[name] = value or environ[name]
    if settings.s3_endpoint_url and "STK_TRAIN_S3_ENDPOINT_URL" not in environ:
        env["STK_TRAIN_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    if settings.s3_retry_seconds is not None and "STK_TRAIN_S3_RETRY_SECONDS" not in environ:
        env["STK_TRAIN_S3_RETRY_SECONDS"] = f"{settings.s3_retry_seconds:g}"
    return env


def default_port(allocation: Allocation) -> int:
    """20000 + job id % 20000: every node of the job (and every requeue) derives the same port;
    outside Slurm, a port free here now."""
    if allocation.job_id and allocation.job_id.isdigit():
        return 20000 + int(allocation.job_id) % 20000
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def default_hostfile(environ: Mapping[str, str]) -> str:
    """$TMPDIR/stk-hostfile-$SLURM_JOB_ID on the batch host, where DeepSpeed's launcher reads it."""
    tag = environ.get("SLURM_JOB_ID") or f"pid{os.getpid()}"
    return os.path.join(tempfile.gettempdir(), f"stk-hostfile-{tag}")


def deepspeed_command(
    impl: str, hostfile: str, allocation: Allocation, env: Mapping[str, str], train_args: Sequence[str]
) -> list[str]:
    """DeepSpeed's runner with its MPI launcher, given the environment it will get; one host needs
    --force_multi or it starts the ranks itself without MPI. Each rank runs RANK_SCRIPT (see the
    module docstring)."""
    if impl == "mpich":
        launcher_args = ["-genvall"]
    else:
        names = sorted(n for n in env if n.startswith(FORWARDED_PREFIXES) and not n.startswith("STK_LAUNCH_"))
        launcher_args = [arg for name in names for arg in ("-x", name)]
        ifname = env.get("NCCL_SOCKET_IFNAME", "")
        if re.fullmatch(r"[\w.-]+(,[\w.-]+)*", ifname):  # a plain list; NCCL's ^ and = prefixes mean nothing to MPI
            launcher_args += ["--mca", "btl_tcp_if_include", ifname]  # replaces DeepSpeed's default: eth0
    command = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--launcher", impl,
        "--master_addr", env["STK_MASTER_ADDR"], "--master_port", env["STK_MASTER_PORT"], "--no_ssh_check",
        "--log_level", "warning", f"--launcher_args={shlex.join(launcher_args)}",
    ]  # fmt: skip
    if len(allocation.hosts) == 1:
        command.append("--force_multi")
    return [*command, RANK_SCRIPT, *train_args]


def srun_command(
    settings: LaunchSettings, allocation: Allocation, train_args: Sequence[str], environ: Mapping[str, str]
) -> list[str]:
    """One srun step with a task per slot; srun passes the environment and signals to every task."""
    command = [
        "srun", f"--mpi={settings.mpi}", f"--nodes={len(allocation.hosts)}",
        f"--ntasks-per-node={allocation.slots}", f"--ntasks={len(allocation.hosts) * allocation.slots}",
    ]  # fmt: skip
    if environ.get("SLURM_CPUS_PER_TASK"):  # newer srun no longer takes it from sbatch by itself
        command.append(f"--cpus-per-task={environ['SLURM_CPUS_PER_TASK']}")
    if settings.hosts_given:
        command.append(f"--nodelist={','.join(allocation.hosts)}")
    return [*command, sys.executable, "-m", TRAIN_MODULE, *train_args]


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


# --- running it ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """One rank's line in the status directory: where it runs, and its exit code once it ended."""

    host: str
    pid: int
    code: int | None  # None: still running, or killed before it could write one


def execute(launch: Launch, environ: Mapping[str, str], dry_run: bool = False, out: TextIO | None = None) -> int:
    """Write the hostfile, then print the launch (dry run) or run it and return the job's code."""
    if launch.hostfile:
        write_atomic(launch.hostfile, launch.allocation.hostfile().encode())
    alloc = launch.allocation
    log.info(
        "%d host(s) x %d rank(s) via %s, rendezvous %s:%s: %s",
        len(alloc.hosts), alloc.slots, launch.via, launch.env["STK_MASTER_ADDR"], launch.env["STK_MASTER_PORT"],
        shlex.join(launch.command),
    )  # fmt: skip
    if dry_run:
        (out or sys.stdout).write(launch.script())
        return int(ExitCode.OK)
    env = {**environ, **launch.env}
    if launch.via == "srun":
        return supervise(launch.command, env)
    if shutil.which("mpirun", path=env.get("PATH")) is None:
        raise InputError("mpirun not found on PATH: load the MPI that mpi4py was built with, or use --via srun")
    return run_ranks(launch.command, env)


def run_ranks(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run a launcher whose ranks start through `run_rank`, and return the job's code from the
    codes the ranks on this node recorded (the launcher's own code where none did)."""
    status_dir = tempfile.mkdtemp(prefix="stk-launch-")
    try:
        code = supervise(command, {**env, RANK_STATUS_ENV: status_dir}, status_dir)
        return job_exit_code(code, [rank.code for rank in read_ranks(status_dir)])
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def supervise(command: Sequence[str], env: Mapping[str, str], status_dir: str | None = None) -> int:
    """Run the launcher and return its exit code (128 + N when signal N killed it). SIGUSR2 and
    SIGTERM meanwhile become SIGUSR2 to the ranks running on this node that registered in
    `status_dir` (once one of them handles it), or without one to the launcher itself (srun,
    which passes it to every task)."""
    requests: list[str] = []

    def request(signum: int, _frame: object) -> None:
        requests.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request) for sig in STOP_REQUESTS}
    try:
        try:
            child = subprocess.Popen(list(command), env=dict(env))
        except OSError as exc:
            raise InputError(f"cannot run {command[0]}: {exc.strerror}") from exc
        code: int | None = None
        waiting = False  # a request is held until a rank can take it
        while code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=0.2)
            if requests and code is None:
                received = requests[-1]
                if status_dir is None:
                    log.warning("%s received: passing SIGUSR2 to srun, which passes it to every task", received)
                    child.send_signal(signal.SIGUSR2)
                elif not _stop_ranks(status_dir, received):
                    if not waiting:
                        log.warning("%s received: no rank on this node handles SIGUSR2 yet; waiting", received)
                    waiting = True
                    continue
                requests.clear()
                waiting = False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _stop_ranks(status_dir: str, received: str) -> bool:
    """SIGUSR2 to the running ranks of this node that handle it; whether there was any. Ranks are
    found through their status files, not the process tree: inside an allocation MPICH's mpirun
    starts them through srun, under slurmstepd, not below stk-launch."""
    host = socket.gethostname()
    running = [r.pid for r in read_ranks(status_dir) if r.host == host and r.code is None]
    pids = [pid for pid in running if _catches(pid, signal.SIGUSR2)]
    if pids:
        log.warning("%s received: asking %d rank(s) on this node to checkpoint (SIGUSR2)", received, len(pids))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    return bool(pids)


def _catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (SigCgt in /proc/PID/status): a rank still starting
    has none yet, and an unhandled SIGUSR2 would kill it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(caught >> (sig - 1) & 1)


def read_ranks(status_dir: str) -> list[RankStatus]:
    """The ranks that registered in `status_dir` (files named HOST-PID, holding "running" or the
    rank's exit code)."""
    ranks = []
    for entry in os.scandir(status_dir):
        host, _, pid = entry.name.rpartition("-")
        if entry.name.startswith(".") or not pid.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError), open(entry.path) as f:
            text = f.read().strip()
            ranks.append(RankStatus(host, int(pid), int(text) if text.lstrip("-").isdigit() else None))
    return ranks


def job_exit_code(launcher_code: int, rank_codes: Sequence[int | None]) -> int:
    """The job's code: a rank's error (the highest), else failure if a rank ended without a code,
    else the GPU-fault code, else the requeue code, else the launcher's own code."""
    ended = [c for c in rank_codes if c is not None]
    errors = [c for c in ended if c not in (ExitCode.OK, ExitCode.REQUEUE, ExitCode.GPU_FAULT)]
    if errors:
        return max(errors)
    if None in rank_codes:
        log.error("%d rank(s) on this node ended without an exit code (killed?)", rank_codes.count(None))
        return launcher_code or int(ExitCode.INTERNAL)
    for code in (ExitCode.GPU_FAULT, ExitCode.REQUEUE):
        if code in ended:
            return int(code)
    return launcher_code


# --- inside each rank ------------------------------------------------------------------------


def run_rank(argv: Sequence[str], main: Callable[..., object] | None = None) -> int:
    """Run stk-train (or `main`) in this process, registered in $STK_RANK_STATUS_DIR as HOST-PID
    while it runs and with its exit code once it ends. Only the launching node has that
    directory: elsewhere nothing is written."""
    directory = os.environ.get(RANK_STATUS_ENV, "")
    status = os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}") if os.path.isdir(directory) else None
    _write_status(status, RUNNING)
    on_abort(lambda code: _write_status(status, str(code)))  # MPI_Abort ends the process: no finally
    code = int(ExitCode.INTERNAL)
    try:
        if main is None:
            from stk.cli.train import main as train_main

            main = train_main
        main(args=list(argv), prog_name="stk-train")
        code = 0
    except SystemExit as exc:
        code = int(exc.code) if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        _write_status(status, str(code))
    return code


def _write_status(path: str | None, text: str) -> None:
    if path is None:
        return
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    # A rank started by DeepSpeed's MPI launcher. Python put stk/ first on sys.path; its modules
    # (config, log, models, train ...) must not shadow top-level ones of other packages.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(RANK_SCRIPT):
        del sys.path[0]
    sys.exit(run_rank(sys.argv[1:]))
