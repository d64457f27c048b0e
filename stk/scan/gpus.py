"""How many GPUs the scan's batch check assumes when --gpus is not given.

The number of ranks running the scan says nothing about the training job: `mpiexec -n 2 stk-scan`
on a CPU machine must give the verdict that one rank gives.
"""

from __future__ import annotations

import os

from stk.cluster.slurm import gpu_count
from stk.health.devices import node_gpu_count

__all__ = ["training_gpus"]


def training_gpus(option: int | None) -> tuple[int, str]:
    """(GPUs, where the number came from): the option; else the Slurm allocation; else this node's
    GPUs by NVML; else 1."""
    if option:
        return option, "option"
    slurm = gpu_count(os.environ)
    if slurm:
        return slurm, "slurm"
    nvml = node_gpu_count()
    if nvml:
        return nvml, "nvml"
    return 1, "default"
