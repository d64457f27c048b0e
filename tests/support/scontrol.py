"""Recorded `scontrol show node` lines and reports for the tests of stk.health.slurm."""

from __future__ import annotations

from stk.health.report import Finding, Report, Severity

# Recorded from slurm-wlm 22.05.8 (`scontrol show node -o vm`), shortened in the middle.
HEAD = "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=8 CPUTot=8 Gres=gpu:8 NodeAddr=127.0.0.1"

TAIL = (
    "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  "
    "BootTime=2026-11-21T22:41:02 SlurmdStartTime=2026-11-22T00:34:46 CfgTRES=cpu=8,mem=1M,billing=8 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)

IDLE = f"{HEAD} State=IDLE {TAIL}\n"


def report(severity: Severity | None, message: str = "GPU 3: volatile uncorrectable ECC errors: 2") -> Report:
    findings = () if severity is None else (Finding("ecc_volatile_uncorrectable", severity, message, gpu_index=3),)
    return Report(host="vm", job_id=None, gpus=8, findings=findings)
