"""The GPU proof kit: everything a GPU can prove about stk, in parts that each fit in 10 minutes, against the loops
users run today, with random weights from the published configs (no hub access).

    python bench/gpu.py [--only PART[,PART...]] [--record] [--workdir DIR] [--compile]
                        [--batch-sizes 4,8] [--variants full-ckpt,...] [--flux-blocks 4,8] [--family-blocks 4]
                        [--cpu]

Parts (in the order `make gpu-check` runs them):

  speed    per --speed-configs (sdxl, flux-dev), batch size and variant: the examples' plain loop, stk-train eager,
           compiled and with --fp8-matmuls, and the ratios against issue 37's targets (bench/gpu_speed.py).
  health   stk-health check against the real NVML: its findings, and its wall time over the interpreter's
           (target < 1 s), with `nvidia-smi -q` timed beside it.
  cache    stk-cache in bf16 with the SDXL VAE on generated images at 1024 px: images/s, against the same images
           encoded one per call (the way the seed trainer's cache loop does it).
  train    stk-train on one GPU, SDXL UNet at 1024 px, bf16, ZeRO-2, per batch size: checkpointing on and off,
           full and LoRA rank 16. samples/s, peak memory (torch.cuda.max_memory_allocated), MFU (forward + backward
           FLOPs from torch.utils.flop_counter over the device's dense bf16 peak), and baseline_ratio against a
           plain loop written as diffusers' train_text_to_image_sdxl.py trains (fp32 weights, torch AdamW, bf16
           autocast, the same batch and checkpointing), on the same cached batch, in a process of its own.
           Targets: >= 1.0x, and >= 1.2x with --compile.
  flux     a Flux.1-dev transformer at full width with --flux-blocks (double, single) blocks at 1024 px through
           stk-train: samples/s and MFU; then Flux.1-dev projected to 32 GPUs at batch 8 (the measured FLOP rate
           over the full model's FLOPs, plus a ring all-reduce of the bf16 gradients at --bus-gbps), beside the
           reference guide's 15 s/step. Goal: <= 7.5 s/step.
  families every other flow family's published config (stk.models.published: SD3.5 Large and Medium, Chroma1,
           Z-Image, and whatever is published next) the same way: full width, --family-blocks blocks per block list
           (bench/denoisers.py says which config keys count them), 1024 px, --flux-batch, full fine-tune with
           checkpointing and LoRA rank 16: samples/s, peak memory, MFU, and the full model projected to 32 GPUs at
           batch 8 (LoRA: the adapter's gradients all-reduced). One row per config and variant; no target.
  breaker  a fixed GPU workload with stk's circuit breaker polling the real NVML every second, against none,
           alternating: overhead in % (target < 0.1%).
  oom      stk-train with a batch far too big for the device: exit 3 with one line within seconds, no traceback,
           no hang.
  quant    the flux part's transformer, LoRA rank 16 with checkpointing, on an int8 and an fp8 base
           (--base-precision) against bf16: samples/s and peak memory of each, baseline_ratio over bf16 (target for
           fp8 >= 1.2x). On a device without fp8 (--cpu; compute capability below 8.9) its row is stk-train's
           one-line refusal (--cpu runs fp8 only); a run that fails is a row with its exit code and its log's end.
  profile  stk-train (SDXL, LoRA rank 16, checkpointing, first batch size) with its step split into train_step and
           the step boundary, torch.profiler's operator tables and timeline, and cProfile's functions, written to
           --profile-dir, and the share of the profiled steps' time the GPU was busy (bench/gpu_profile.py; with
           --compile, compiled: target 90%).

Every part prints one JSON object per measurement with at least `part`, `samples_per_s`, `peak_memory`, `mfu` and
`baseline_ratio` (null where they do not apply). `--record` appends them to bench/RESULTS.md as a table headed by
the device, driver, torch and CUDA versions and the date. `--cpu` runs every part on tiny shapes on the CPU (the
test suite does, so that the kit cannot rot); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from gpu_parts import (
    baseline_child,
    part_breaker,
    part_cache,
    part_families,
    part_flux,
    part_health,
    part_oom,
    part_quant,
    part_train,
)
from gpu_profile import part_profile
from gpu_setup import KEYS, Scale, peak_tflops
from gpu_speed import SPEED_CONFIGS, part_speed

PARTS = ("speed", "profile", "health", "cache", "train", "flux", "families", "breaker", "oom", "quant")
VARIANTS = ("full-ckpt", "full", "lora-ckpt", "lora")  # full or LoRA rank 16, gradient checkpointing on or off


REPO = Path(__file__).resolve().parent.parent


# The tiny shapes of --cpu: the published configs with small widths (the code path is the same); the transformers take
# their family's own tiny widths (gpu_setup.tiny_widths).
# a wide first block (the published VAE's 128 channels): oom's first activation outgrows the address space at 16
# images of 1024 px
TINY_VAE = {"block_out_channels": [128, 64, 64, 64], "layers_per_block": 1}
TINY_SDXL = {
    "block_out_channels": [32, 64, 64],
    "attention_head_dim": [2, 4, 4],
    "layers_per_block": 1,
    "transformer_layers_per_block": [1, 1, 1],
    "cross_attention_dim": 96,
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 112,
}


GPU = Scale("cuda", 1024, 64, 12, (4, 8), VARIANTS, (4, 8), 2, 64)
CPU = Scale("cpu", 64, 8, 3, (2,), ("lora",), (1, 1), 2, 16, TINY_SDXL, TINY_VAE, 1, ("lora-ckpt",), ("fp8",))


PART_RUNNERS: dict[str, Callable[[Scale, Path, argparse.Namespace], Iterator[dict[str, Any]]]] = {
    "health": part_health,
    "cache": part_cache,
    "train": part_train,
    "flux": part_flux,
    "families": part_families,
    "breaker": part_breaker,
    "oom": part_oom,
    "quant": part_quant,
    "profile": part_profile,
    "speed": part_speed,
}


# ------------------------------------------------------------------------------------------------ recording


def environment() -> dict[str, Any]:
    _, name = peak_tflops(None)
    driver = None
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "device": name,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": date,
        "host": platform.node(),
    }


def record(path: Path, command: str, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Append the results as a table: one row per measurement, its other fields as JSON."""

    def cell(value: Any) -> str:
        return "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)

    lines = [
        "",
        f"### GPU proof kit: {env['device']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"{env['date']}",
        "",
        f"`{command}`",
        "",
        "| part | samples/s | peak memory (GiB) | MFU | baseline ratio | ok | details |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        peak = row["peak_memory"]
        rest = {k: v for k, v in row.items() if k not in ("part", "ok", *KEYS)}
        lines.append(
            f"| {row['part']} | {cell(row['samples_per_s'])} | {'' if peak is None else f'{peak / 2**30:.1f}'}"
            f" | {cell(row['mfu'])} | {cell(row['baseline_ratio'])} | {cell(row.get('ok'))} | "
            f"{cell(rest).replace('|', '/')} |"
        )
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts: {', '.join(PARTS)}")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU: the smoke run of the tests")
    parser.add_argument("--record", action="store_true", help="append the results to --results")
    parser.add_argument("--results", default=str(REPO / "bench" / "RESULTS.md"))
    parser.add_argument("--workdir", default=None, help="keep models, images, scans and caches here between runs")
    parser.add_argument("--compile", action="store_true", help="train, profile: stk-train --compile default")
    speed_help = f"speed: comma list of {', '.join(SPEED_CONFIGS)} [all; --cpu: sdxl]"
    parser.add_argument("--speed-configs", default=None, help=speed_help)
    parser.add_argument("--batch-sizes", type=parse_ints, default=None, help="train: per-GPU batch sizes [4,8]")
    parser.add_argument("--variants", default=None, help=f"train: comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--flux-blocks", type=parse_ints, default=None, help="flux: double,single blocks [4,8]")
    parser.add_argument("--flux-batch", type=int, default=None, help="flux and families: per-GPU batch [2]")
    parser.add_argument("--family-blocks", type=int, default=None, help="families: blocks per block list [4]")
    parser.add_argument(
        "--bus-gbps",
        type=float,
        default=50.0,
        help="flux projection: all-reduce bus bandwidth per GPU, GB/s (8x400 Gb/s IB per node: 50)",
    )
    parser.add_argument("--profile-dir", default=None, help="profile: where its tables and trace go [WORKDIR/profile]")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (MFU)")
    parser.add_argument("--baseline-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_child:
        print(json.dumps(baseline_child(json.loads(args.baseline_child))))
        return
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose from {', '.join(PARTS)}")
    scale = CPU if args.cpu else GPU
    if not scale.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: this kit proves stk on a GPU (--cpu runs its smoke test)")
    variants = tuple(v for v in (args.variants or "").split(",") if v) or scale.variants
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
    scale = replace(
        scale,
        variants=variants,
        batch_sizes=args.batch_sizes or scale.batch_sizes,
        flux_blocks=args.flux_blocks or scale.flux_blocks,
        flux_batch=args.flux_batch or scale.flux_batch,
        family_blocks=args.family_blocks or scale.family_blocks,
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stk-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(json.dumps({"environment": env, "workdir": str(work)}), flush=True)
    command = " ".join(["python bench/gpu.py", *sys.argv[1:]])
    for part in parts:  # each part recorded as it ends: a later part cut short by the slot's end loses only itself
        results = []
        for row in PART_RUNNERS[part](scale, work, args):
            print(json.dumps(row), flush=True)
            results.append(row)
        if args.record:
            record(Path(args.results), command, env, results)


if __name__ == "__main__":
    main()
