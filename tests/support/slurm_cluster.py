"""A real one-node Slurm cluster for the session (Debian slurm-wlm + munge), for tests that drive
scontrol, sinfo, sbatch or srun as a cluster would.

The node is named after the short hostname and has CPUs=8 and 8 fake GPUs (character devices
made with mknod, so Slurm sets CUDA_VISIBLE_DEVICES). Config, state, spool, logs and pid files
live in a fresh temp dir and the daemons listen on free ports, so a second run on the same
machine never meets the first one's leftovers. Without the binaries the tests are skipped,
unless CI is set: CI must run them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["SlurmClient", "SlurmCluster", "slurm_cluster"]

BINARIES = ("slurmctld", "slurmd", "munged", "munge", "scontrol", "sinfo", "sbatch", "squeue")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
GPUS, CPUS = 8, 8
START_TIMEOUT_S = 30
# slurm.conf lines every test cluster shares: no cgroups, no accounting, MPI only when asked, fake GPUs by gres
CONF_COMMON = """SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
"""


class SlurmClient:
    """What a test does with a running cluster through Slurm's clients: needs `env` (with SLURM_CONF), `jobs_dir`,
    `daemons`, `root`, and the cluster class's `node_names()` and `log_files()`."""

    env: dict[str, str]
    jobs_dir: Path
    root: Path
    daemons: dict[str, subprocess.Popen[bytes]]

    def node_names(self) -> list[str]:
        raise NotImplementedError

    def log_files(self) -> list[str]:
        """The daemons' logs, relative to `root`."""
        raise NotImplementedError

    def states(self) -> dict[str, str]:
        """sinfo's state per node ("idle", "idle*", "alloc", "drain" ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until sinfo says plain "idle" for every node (a RESUME leaves a node "idle*", not responding, ~1 s)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states()
            if sorted(states) == sorted(self.node_names()) and set(states.values()) == {"idle"}:
                return
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"nodes not idle within {timeout} s ({states}):\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 3000) -> str:
        """The end of the daemons' logs, for failure messages."""
        parts = []
        for name in self.log_files():
            path = self.root / name
            text = path.read_text(errors="replace")[-tail:] if path.exists() else "(none)"
            parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)

    def run(self, args: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (scontrol, sinfo, srun ...) against this cluster; text output."""
        proc = subprocess.run(
            [str(a) for a in args], capture_output=True, text=True, env=self.env, timeout=timeout, cwd=self.jobs_dir
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def submit(self, script: str | Path, *args: str, options: Sequence[str] = (), timeout: float = 60) -> str:
        """sbatch SCRIPT ARGS (a Path, or the script's text), wait until the job left the queue; its id.
        Output goes to `output(job_id)` unless `options` say otherwise."""
        if not isinstance(script, Path):
            fd, name = tempfile.mkstemp(suffix=".sh", dir=self.jobs_dir)
            os.close(fd)
            Path(name).write_text(script)
            script = Path(name)
        proc = self.run(["sbatch", "--parsable", *options, str(script), *args])
        job_id = proc.stdout.strip().split(";")[0]
        self.wait(job_id, timeout)
        return job_id

    def wait(self, job_id: str, timeout: float = 60) -> None:
        """Poll `squeue -h -j` until the job is finished or gone (cheaper than sbatch --wait)."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
            state = proc.stdout.strip()
            if proc.returncode != 0 or not state or state in FINISHED:
                return
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise AssertionError(f"job {job_id} still {state} after {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def output(self, job_id: str) -> str:
        """The default sbatch output file's text (slurm-JOBID.out in jobs_dir)."""
        return (self.jobs_dir / f"slurm-{job_id}.out").read_text()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, ExitCode, ...); kept for MinJobAge after the end."""
        line = self.run(["scontrol", "show", "job", "-o", job_id]).stdout.strip()
        return dict(part.split("=", 1) for part in line.split() if "=" in part)


@dataclass
class SlurmCluster(SlurmClient):
    """The running cluster: `env` (with SLURM_CONF) is what subprocesses need to reach it."""

    node: str
    partition: str
    root: Path
    conf: Path
    env: dict[str, str]
    gpus: int = GPUS
    cpus: int = CPUS
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    jobs_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.jobs_dir = self.root / "jobs"
        self.jobs_dir.mkdir(exist_ok=True)

    def node_names(self) -> list[str]:
        return [self.node]

    def log_files(self) -> list[str]:
        return ["slurmctld.log", "slurmd.log"]


def _missing_prerequisites() -> list[str]:
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd and mknod need it)")
    return missing


def free_ports(count: int) -> list[int]:
    """Ports free right now on 127.0.0.1 (all held open together, so they are distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _munge_answers() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5, check=True).stdout
        return subprocess.run(["unmunge"], input=cred, capture_output=True, timeout=5).returncode == 0
    return False


def _start_munged(root: Path) -> subprocess.Popen[bytes] | None:
    """Reuse a munged that answers; else start one as user munge (--force: a stale socket is fine)."""
    if _munge_answers():
        return None
    if not MUNGE_KEY.exists():
        subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True, capture_output=True)
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o600)
    MUNGE_SOCKET.parent.mkdir(mode=0o755, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    with open(root / "munged.out", "wb") as out:
        proc = subprocess.Popen(
            ["munged", "--foreground", "--force"], user="munge", group="munge", stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 10
    while not _munge_answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"munged did not start:\n{(root / 'munged.out').read_text(errors='replace')}")
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def _write_config(root: Path, node: str, partition: str) -> Path:
    """slurm.conf and gres.conf under root, fake GPU devices, state and spool dirs; the slurm.conf path."""
    for name in ("state", "spool", "dev"):
        (root / name).mkdir()
    devices = []
    for index in range(GPUS):
        device = root / "dev" / f"nvidia{index}"
        subprocess.run(["mknod", str(device), "c", "1", "3"], check=True, capture_output=True)
        devices.append(str(device))
    ctld_port, slurmd_port = free_ports(2)
    # Job ids start anywhere, not at 1: MPICH under `srun --mpi=pmi2` names its shared-memory segment
    # after the job and step, and a step that ended in MPI_Abort leaves it in /dev/shm; the next
    # cluster's job with the same id then fails in MPI_Init ("Message truncated") or hangs.
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=stk-test
FirstJobId={random.randrange(1000, 60_000_000)}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
{CONF_COMMON}NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    )
    (root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={node} Name=gpu File={root}/dev/nvidia[0-{GPUS - 1}]\n")
    return conf


@contextlib.contextmanager
def start_cluster(partition: str = "debug") -> Iterator[SlurmCluster]:
    """Start munged (if none answers), slurmctld and slurmd; stop what was started on exit."""
    missing = _missing_prerequisites()
    if missing:
        message = f"real Slurm unavailable, missing: {', '.join(missing)} (apt-get install slurm-wlm munge)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI is set, so this must not be skipped")
        pytest.skip(message)
    root = Path(tempfile.mkdtemp(prefix="stk-slurm-"))
    node = socket.gethostname().split(".")[0]
    conf = _write_config(root, node, partition)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(node, partition, root, conf, env)
    munged = None
    try:
        munged = _start_munged(root)
        for command in (["slurmctld", "-D", "-c", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf), "-N", node]):
            with open(root / f"{command[0]}.out", "wb") as out:
                cluster.daemons[command[0]] = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        cluster.wait_idle()
        yield cluster
    finally:
        for proc in reversed(cluster.daemons.values()):
            _stop(proc)
        if munged is not None:
            _stop(munged)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster for the session (see the module docstring)."""
    with start_cluster() as cluster:
        yield cluster
