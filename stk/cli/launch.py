"""stk-launch: click wiring, and which scripts the ranks run; the work is in stk.launch."""

from __future__ import annotations

import os
from typing import Any

import click
from click.core import ParameterSource

from stk.cli import rank
from stk.cli.common import CONTEXT, common_options, default_of, options_from, run_command, run_process
from stk.cluster.world import World
from stk.launch.allocation import read_allocation
from stk.launch.plan import MPI_IMPLS, VIAS, LaunchSettings, RankEntry, plan_launch
from stk.launch.supervise import execute

# What the ranks run: this package's rank script under DeepSpeed's MPI launcher, stk-train under srun.
RANK_ENTRY = RankEntry(script=os.path.abspath(rank.__file__), module="stk.cli.train")

EPILOG = """\b
Examples (from an sbatch script or salloc; everything after -- goes to stk-train):
  stk-launch -- --cache /shared/cache --model ./sdxl --output-dir /shared/run1
  stk-launch --config run.toml -- --config run.toml     # [launch] here, [train] for stk-train
  stk-launch --via srun --mpi pmix -- --config run.toml
  stk-launch --hosts localhost --slots-per-node 2 --master-addr 127.0.0.1 -- --cache C --model M --output-dir O

\b
It writes the hostfile (`host slots=N`, N = GPUs per node), sets STK_MASTER_ADDR (the first
host) and STK_MASTER_PORT (20000 + job id % 20000), TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
HDF5_USE_FILE_LOCKING=FALSE and the NCCL and gloo interfaces for every rank, and runs
`deepspeed --launcher mpich|openmpi` (or srun). SIGUSR2 or SIGTERM to stk-launch asks the ranks
to checkpoint (SIGUSR2 to stk-train); it waits for them and exits with their code.

\b
Exit codes: those of stk-train (0 finished, 75 checkpointed: requeue, 76 GPU fault, 3, 5, 6,
7, 69 ...), also when DeepSpeed's launcher loses them; 2 bad option; 3 not inside an allocation
and no --hosts, or no slot count; 69 mpirun or srun cannot be run here.
"""


@click.command(
    "launch",
    context_settings={**CONTEXT("launch"), "ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=EPILOG,
)
@click.option(
    "--via",
    type=click.Choice(VIAS),
    default=default_of(LaunchSettings, "via"),
    show_envvar=True,
    help="DeepSpeed's MPI launcher, or one srun step.",
)
@click.option(
    "--mpi",
    default=default_of(LaunchSettings, "mpi"),
    show_envvar=True,
    help="srun's MPI plugin with --via srun: pmi2 for MPICH, pmix for OpenMPI.",
)
@click.option(
    "--mpi-impl",
    type=click.Choice(MPI_IMPLS),
    default=None,
    show_envvar=True,
    help="DeepSpeed's --launcher [default: the MPI library mpi4py loads].",
)
@click.option(
    "--hosts",
    default=None,
    show_envvar=True,
    help="Comma-separated hosts, in rank order [default: the Slurm job's nodes].",
)
@click.option(
    "--slots-per-node",
    type=click.IntRange(1),
    default=None,
    show_envvar=True,
    help="Ranks per host [default: GPUs per node from Slurm, else its tasks per node].",
)
@click.option(
    "--hostfile",
    default=None,
    type=click.Path(dir_okay=False),
    show_envvar=True,
    help="Where to write the hostfile [default: $TMPDIR/stk-hostfile-$SLURM_JOB_ID].",
)
@click.option(
    "--master-addr",
    default=None,
    show_envvar=True,
    help="Rank 0's address for the rendezvous [default: $STK_MASTER_ADDR, else the first host].",
)
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=None,
    show_envvar=True,
    help="Rendezvous port [default: $STK_MASTER_PORT, else 20000 + job id % 20000].",
)
@click.option(
    "--nccl-socket-ifname",
    default=None,
    show_envvar=True,
    help="NCCL_SOCKET_IFNAME for every rank, e.g. ib0 or ^lo,docker [default: as set].",
)
@click.option(
    "--nccl-ib-hca",
    default=None,
    show_envvar=True,
    help="NCCL_IB_HCA for every rank, e.g. mlx5_0,mlx5_1 [default: as set].",
)
@click.option(
    "--gloo-socket-ifname",
    default=None,
    show_envvar=True,
    help="GLOO_SOCKET_IFNAME for every rank (CPU collectives), e.g. eth0 [default: as set].",
)
@click.option("--dry-run", is_flag=True, help="Write the hostfile, print the environment and the command; run nothing.")
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED, metavar="[--] STK-TRAIN-ARGS...")
@common_options
def main(
    hosts: str | None,
    slots_per_node: int | None,
    dry_run: bool,
    train_args: tuple[str, ...],
    verbose: int,
    quiet: bool,
    **params: Any,
) -> None:
    """Start stk-train on every GPU of this Slurm allocation, from inside it.

    Run it once, from the batch script (the first node of the job). Arguments after the options
    (or after --) go to stk-train unchanged; --s3-endpoint-url and --s3-retry-seconds, when set, are
    passed on to it too.
    """
    retry_given = click.get_current_context().get_parameter_source("s3_retry_seconds") != ParameterSource.DEFAULT
    settings = options_from(
        LaunchSettings,
        params,
        s3_retry_seconds=params["s3_retry_seconds"] if retry_given else None,
        hosts_given=bool(hosts),
    )
    args = list(train_args)
    if args[:1] == ["stk-train"]:  # `stk-launch stk-train ARGS` reads like `srun stk-train ARGS`
        args = args[1:]

    def body(world: World) -> int:
        allocation = read_allocation(os.environ, hosts, slots_per_node)
        return execute(plan_launch(settings, allocation, args, os.environ, RANK_ENTRY), os.environ, dry_run)

    run_command(
        "stk-launch", verbose, quiet, settings.s3_endpoint_url, body, s3_retry_seconds=params["s3_retry_seconds"]
    )


def entry() -> None:
    """The `stk-launch` executable."""
    run_process(main, "stk-launch")


if __name__ == "__main__":
    entry()
