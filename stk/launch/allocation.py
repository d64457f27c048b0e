"""The hosts stk-launch runs on and how many ranks each gets: from the options, else from Slurm."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stk.cluster import slurm
from stk.errors import InputError

__all__ = ["Allocation", "read_allocation"]


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
    if hosts:
        names = tuple(h.strip() for h in hosts.split(",") if h.strip())
    elif (job_hosts := slurm.job_hosts(environ)) is not None:
        names = tuple(job_hosts)
    else:
        raise InputError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST is unset): run stk-launch from an sbatch script "
            "or salloc, or give --hosts h1,h2 --slots-per-node N"
        )
    if not names:
        raise InputError(f"--hosts {hosts!r} names no host")
    if len(set(names)) != len(names):
        raise InputError(f"--hosts {hosts!r} names a host twice")
    slots = slots or slurm.slots_per_node(environ)
    if not slots:
        raise InputError(
            "cannot tell how many ranks to start per node: Slurm sets no GPU or task count "
            "(SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, SLURM_NTASKS_PER_NODE); give --slots-per-node N"
        )
    return Allocation(names, slots, slurm.job_id(environ))
