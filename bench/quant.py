"""The quantised frozen base (stk-train --base-precision) against bf16 on the CPU: a FLUX.1-dev transformer at full
width (3072) with --blocks (double, single) blocks, random bf16 weights, loaded as stk-train loads it
(stk.train.trainable.weights.load_weights, each linear layer quantised as it is read), a LoRA of rank 16 added as
stk-train adds it, then LoRA training steps (forward, MSE, backward) at --resolution px, with gradient checkpointing as
stk-train's default (--no-gradient-checkpointing: without).

    python bench/quant.py [--blocks 1,1] [--resolution 256] [--tokens 64] [--steps 3] [--threads 2]
                          [--no-gradient-checkpointing]

Each precision runs in a fresh process of this script and reports: the base's bytes (each tensor's storage, torchao's
packed int8 data and scales included: torchao.utils.get_model_size_in_bytes), the RSS high-water mark of the load and
of the training steps (VmHWM, started afresh after the load), and the median step time after the first. The side by
side table ends with the int8 / bf16 ratios. Expect int8 slower on the CPU: it dequantises each weight in every
forward and backward pass (pure PyTorch). The step's peak holds, besides the int8 base, the weights that torchao
casts to bf16 for the matmul and autograd saves for the backward pass: one block's under checkpointing, every
layer's without.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from denoisers import step_inputs, training_forward
from memory_measure import reset_peak, status_bytes

CONFIG = "flux-dev"
LORA_RANK = 16


def build(folder: Path, blocks: tuple[int, int]) -> None:
    """The transformer with random bf16 weights, saved as stk-train reads it (safetensors)."""
    from stk.models.published import build_published, published_config

    torch.manual_seed(0)
    config = published_config(CONFIG, "denoiser", num_layers=blocks[0], num_single_layers=blocks[1])
    build_published(config, "cpu").to(torch.bfloat16).save_pretrained(folder)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One precision: load, add the LoRA, train; in this process."""
    from torchao.utils import get_model_size_in_bytes

    from stk.models.families import Family, spec_for
    from stk.models.weightfiles import weight_files
    from stk.train.trainable.baseprecision import quantizer
    from stk.train.trainable.lora import LoraSettings, add_lora
    from stk.train.trainable.weights import load_weights

    torch.set_num_threads(spec["threads"])
    folder = Path(spec["folder"])
    config = json.loads((folder / "config.json").read_text())
    before = status_bytes("VmRSS")
    started = time.perf_counter()
    denoiser = load_weights(
        spec_for(Family.FLUX).denoiser.model_class,
        config,
        weight_files(folder),
        torch.bfloat16,
        quantizer(spec["precision"]),
    )
    load_s, load_peak = time.perf_counter() - started, status_bytes("VmHWM") - before
    base_bytes = get_model_size_in_bytes(denoiser)
    add_lora(denoiser, LoraSettings(rank=LORA_RANK), Family.FLUX, seed=0)
    denoiser.train()
    if spec["checkpointing"]:
        denoiser.enable_gradient_checkpointing()
    inputs = step_inputs(CONFIG, config, spec["resolution"], spec["tokens"], torch.bfloat16)
    reset_peak()
    held = status_bytes("VmRSS")
    times = []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        prediction, target = training_forward(CONFIG, denoiser, inputs)
        F.mse_loss(prediction.float(), target.float()).backward()
        times.append(time.perf_counter() - started)
    step_peak = status_bytes("VmHWM") - before
    return {
        "precision": spec["precision"],
        "base_bytes": base_bytes,
        "load_s": round(load_s, 2),
        "load_peak_bytes": load_peak,
        "held_bytes": held - before,
        "step_peak_bytes": step_peak,
        "step_s": round(statistics.median(times[1:] or times), 3),
    }


def in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """measure(spec) in a fresh process: its RSS high-water mark is its own."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MALLOC_MMAP_THRESHOLD_": "262144"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{spec['precision']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def report(rows: list[dict[str, Any]]) -> None:
    print("| base | base bytes | load peak RSS | held after load | step peak RSS | step s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        gb = [f"{r[k] / 1e9:.3f} GB" for k in ("base_bytes", "load_peak_bytes", "held_bytes", "step_peak_bytes")]
        print(f"| {r['precision']} | {' | '.join(gb)} | {r['step_s']} |")
    bf16, *others = rows
    for r in others:
        ratios = {k: round(r[k] / bf16[k], 3) for k in ("base_bytes", "load_peak_bytes", "step_peak_bytes", "step_s")}
        print(f"{r['precision']} / bf16: {json.dumps(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="1,1", help="double,single blocks of FLUX.1-dev's 19,38")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="text tokens")
    parser.add_argument("--steps", type=int, default=3, help="training steps; the first is left out of the time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default="bf16,int8")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))), flush=True)
        return
    double, single = (int(n) for n in args.blocks.split(","))
    with tempfile.TemporaryDirectory(prefix="stk-quant-") as scratch:
        build(Path(scratch), (double, single))
        rows = []
        for precision in args.precisions.split(","):
            spec = {
                "folder": scratch,
                "precision": precision,
                "resolution": args.resolution,
                "tokens": args.tokens,
                "steps": args.steps,
                "threads": args.threads,
                "checkpointing": not args.no_gradient_checkpointing,
            }
            rows.append(in_child(spec))
            print(json.dumps(rows[-1]), flush=True)
    report(rows)


if __name__ == "__main__":
    main()
