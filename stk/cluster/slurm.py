"""What Slurm says about the job this process runs in, read in one place.

Everything else asks this module: the hosts of a node list, the GPUs and tasks per node, this
task's place in its srun step, the rendezvous port a job derives from its id, and `scontrol`.
Functions take the environment as a mapping so that tests can pass one.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from stk.errors import InfraError, InputError

__all__ = [
    "STOP_SIGNALS",
    "Task",
    "cpus_per_task",
    "env_int",
    "free_port",
    "gpu_count",
    "gpus_per_node",
    "hostnames",
    "job_hosts",
    "job_id",
    "job_port",
    "restart_count",
    "scontrol",
    "slots_per_node",
    "step_size",
    "step_task",
]

SCONTROL_TIMEOUT_S = 30
# What asks a job to stop: USR2 from `--signal=B:USR2@180` before the time limit or on preemption,
# TERM from scancel or a node going down. stk-launch passes both on; stk-train checkpoints on both.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


@dataclass(frozen=True)
class Task:
    """This process as one task of an srun step, from the variables srun sets for it."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: str
    port: int  # job_port of the job and step: the same on every task
    nodelist: str | None

    def first_host(self) -> str:
        """The step's first host, where task 0 runs (and so where it listens)."""
        if not self.nodelist:
            raise InputError("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset: set STK_MASTER_ADDR")
        return hostnames(self.nodelist)[0]


def env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A whole-number variable (Slurm's or a launcher's); InputError naming it when it is not one."""
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value or "")
    except ValueError:
        raise InputError(f"{name}={value!r} is not a whole number") from None


def job_id(environ: Mapping[str, str]) -> str | None:
    """The Slurm job id; None outside a job."""
    return environ.get("SLURM_JOB_ID") or None


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm has requeued this job (0 for its first attempt, and outside a job)."""
    restart = environ.get("SLURM_RESTART_COUNT", "0")
    return int(restart) if restart.isdigit() else 0


def hostnames(nodelist: str) -> list[str]:
    """Host names of a Slurm node list ("gpu[01-03,07],login1"), as `scontrol show hostnames`
    expands it, without a subprocess."""
    try:
        hosts: list[str] = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist:
        hosts = []
    if not hosts:
        raise InputError(f"cannot read the Slurm node list {nodelist!r}")
    return hosts


def job_hosts(environ: Mapping[str, str]) -> list[str] | None:
    """The job's hosts in rank order; None outside an allocation."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return hostnames(nodelist) if nodelist else None


def _count(value: str) -> int | None:
    """A GPU or task count as Slurm writes it: "8", "h100:8", "gpu:h100:8"; "h100:4,a100:4"
    counts 8. None when no part of it is a number."""
    counts = [re.match(r"\d+", item.rsplit(":", 1)[-1]) for item in value.split(",")]
    numbers = [int(m[0]) for m in counts if m]
    return sum(numbers) if numbers else None


def _nodes(environ: Mapping[str, str]) -> int | None:
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    return int(nodes) if nodes.isdigit() and int(nodes) > 0 else None


def gpus_per_node(environ: Mapping[str, str]) -> int | None:
    """GPUs the job has on each node: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else the job's
    SLURM_GPUS spread evenly over its nodes; None outside a job or when it holds no GPUs."""
    if job_id(environ) is None:
        return None
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        count = _count(environ.get(name, ""))
        if count:
            return count
    total, nodes = _count(environ.get("SLURM_GPUS", "")), _nodes(environ)
    if not total or nodes is None or total % nodes:
        return None
    return total // nodes


def gpu_count(environ: Mapping[str, str]) -> int | None:
    """GPUs in the whole allocation: SLURM_GPUS, else the GPUs per node times the nodes; None
    outside a job or when it holds no GPUs."""
    if job_id(environ) is None:
        return None
    total = _count(environ.get("SLURM_GPUS", ""))
    if total is not None:
        return total
    per_node, nodes = gpus_per_node(environ), _nodes(environ)
    return per_node * nodes if per_node and nodes else None


def slots_per_node(environ: Mapping[str, str]) -> int | None:
    """Ranks to start on each node: its GPUs, else the job's tasks per node; None when Slurm
    says neither."""
    if job_id(environ) is None:
        return None
    return gpus_per_node(environ) or _count(environ.get("SLURM_NTASKS_PER_NODE", "")) or None


def cpus_per_task(environ: Mapping[str, str]) -> str | None:
    """--cpus-per-task as the job was given it; a newer srun no longer takes it from sbatch by itself."""
    return environ.get("SLURM_CPUS_PER_TASK") or None


def step_size(environ: Mapping[str, str]) -> int:
    """Tasks in this srun step; 1 outside one."""
    return env_int(environ, "SLURM_STEP_NUM_TASKS", 1)


def step_task(environ: Mapping[str, str]) -> Task | None:
    """This process's place in its srun step; None outside one (a batch script is no step)."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    return Task(
        rank=env_int(environ, "SLURM_PROCID"),
        size=step_size(environ),
        local_rank=env_int(environ, "SLURM_LOCALID", 0),
        local_size=_tasks_on_node(per_node, env_int(environ, "SLURM_NODEID", 0)),
        node=environ.get("SLURMD_NODENAME") or socket.gethostname(),
        port=job_port(env_int(environ, "SLURM_JOB_ID", 0), env_int(environ, "SLURM_STEP_ID", 0)),
        nodelist=environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST"),
    )


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The task count of node `node_id` in Slurm's "2(x3),1" notation (1 when it cannot tell)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return 1
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts[node_id] if node_id < len(counts) else 1


def job_port(job: int, step: int = 0) -> int:
    """20000 + (job id + step id) % 20000: every node of a job (and every requeue) derives the
    same port without talking; the step keeps two steps of one job apart."""
    return 20000 + (job + step) % 20000


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous that only this host announces."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def scontrol(*args: str) -> str:
    """Run scontrol and return what it printed. Missing or not answering is this node's or the
    controller's fault (InfraError); a refusal is reported with scontrol's own words (InputError)."""
    command = ["scontrol", *args]
    if shutil.which("scontrol") is None:
        raise InfraError(f"`{' '.join(command)}`: scontrol not found on PATH")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise InfraError(f"`{' '.join(command)}` did not answer within {SCONTROL_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}"
        raise InputError(f"`{' '.join(command)}` failed: {detail}")
    return proc.stdout
