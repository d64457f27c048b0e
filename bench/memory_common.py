"""What bench/memory.py's parts share: the models' published configs, running one measurement in a
fresh process of bench/memory.py, and how figures are printed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from stk.models.published import published_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory.py")  # its --child runs measure()
GB = 1e9
LORA_RANK = 16
SDXL_UNET = published_config("sdxl", "denoiser")


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """measure(spec) in a fresh process, so that its RSS high-water mark is its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    # A fixed mmap threshold: every tensor over 256 KiB gets its own mapping and goes back to the OS when freed, so
    # RSS follows the live tensors instead of what glibc's heap keeps (its threshold would otherwise grow to 32 MiB).
    env.update(OMP_NUM_THREADS=str(spec["threads"]), MALLOC_MMAP_THRESHOLD_="262144", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def activation_bytes(r: dict[str, Any]) -> float:
    """What the step added on top of the built model, less the gradients held (the largest one when they are
    dropped as they land, all of them for LoRA): saved activations plus the backward pass's working set."""
    held = r.get("grad_bytes", r["largest_grad_bytes"])
    return float(r["peak_rss"] - r["model_rss"] - held)


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


Runs = dict[tuple[str, bool, int], dict[str, Any]]  # (train | lora, checkpointing, resolution) -> measure()


def sdxl_spec(mode: str, checkpointing: bool, resolution: int, args: argparse.Namespace) -> dict:
    return {
        "model": "sdxl",
        "mode": mode,
        "checkpointing": checkpointing,
        "resolution": resolution,
        "steps": args.steps,
        "threads": args.threads,
    }
