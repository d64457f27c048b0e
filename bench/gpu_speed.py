"""bench/gpu.py's speed part: stk-train's step against the examples' plain loop, eager, compiled and in float8.

For each of --speed-configs (sdxl: the published UNet; flux-dev: the published width at --flux-blocks depth), each
of --batch-sizes and each of --variants (full-ckpt, lora-ckpt: checkpointing on, as a 1024 px run needs), four runs
on the same cached batch at the kit's resolution, each a process of its own:

  plain     the examples' loop (gpu_parts.baseline: fp32 weights under bf16 autocast, fused AdamW)
  eager     stk-train, ZeRO-2, bf16
  compiled  stk-train --compile default
  fp8       stk-train --compile default --fp8-matmuls (on a GPU below compute capability 8.9: its refusal)

One row per config, batch and variant: each run's samples/s, and the ratios the targets are set on: eager / plain
(>= 1.0), compiled / eager (>= 1.25), fp8 / compiled bf16 (>= 1.2, set for FLUX.1). Each row takes four to five minutes
on an H100 (most of it loading and compiling), so a 15-minute device slot runs two or three rows: pick them with
--speed-configs, --batch-sizes and --variants, most important first (docs/development/gpu-kit.md).
--cpu leaves the compiled run out and runs fp8 eager (tests/integration/test_train_compile.py covers --compile on
the CPU): its numbers mean nothing, its keys and arithmetic do.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpu_parts import TARGETS, baseline, result, train_stk
from gpu_setup import Scale

SPEED_CONFIGS = ("sdxl", "flux-dev")


def part_speed(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    compiled = [] if scale.cpu else ["--compile", "default"]
    configs = [c for c in (args.speed_configs or ("sdxl" if scale.cpu else ",".join(SPEED_CONFIGS))).split(",") if c]
    for name in configs:
        for batch in scale.batch_sizes:
            for variant in scale.variants:
                runs = {
                    "plain": baseline(scale, work, name, batch, variant),
                    "eager": train_stk(scale, work, name, batch, variant, [], refusable=True),
                }
                if compiled:
                    runs["compiled"] = train_stk(scale, work, name, batch, variant, compiled, refusable=True)
                fp8 = [*compiled, "--fp8-matmuls"]
                runs["fp8"] = train_stk(scale, work, name, batch, variant, fp8, refusable=True)
                yield speed_row(name, batch, variant, runs)


def speed_row(name: str, batch: int, variant: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The row of one config, batch and variant: each run's numbers and the ratios against their targets (fp8
    against the bf16 run made as it was: compiled, or eager under --cpu)."""

    def ratio(over: str, under: str) -> float | None:
        a, b = runs.get(over, {}).get("samples_per_s"), runs.get(under, {}).get("samples_per_s")
        return round(a / b, 3) if a and b else None

    bf16 = "compiled" if "compiled" in runs else "eager"
    ratios = {
        "eager_vs_plain": (ratio("eager", "plain"), TARGETS["baseline_ratio"]),
        "compiled_vs_eager": (ratio("compiled", "eager"), TARGETS["compiled_ratio"]),
        "fp8_vs_bf16": (ratio("fp8", bf16), TARGETS["fp8_ratio"]),
    }
    met = [value >= target for value, target in ratios.values() if value is not None]
    return result(
        "speed",
        config=name,
        variant=variant,
        batch=batch,
        compiled="compiled" in runs,
        samples_per_s=runs["eager"].get("samples_per_s"),
        peak_memory=runs["eager"].get("peak_memory"),
        baseline_ratio=ratios["eager_vs_plain"][0],
        **{key: value for key, (value, _) in ratios.items()},
        targets={key: target for key, (_, target) in ratios.items()},
        runs={run: _brief(numbers) for run, numbers in runs.items()},
        ok=all(met) if met else None,
    )


def _brief(numbers: dict[str, Any]) -> dict[str, Any]:
    """A run's numbers, a failed run's log end cut to its last line (the whole is too long for a table cell)."""
    lines = str(numbers.get("error", "")).strip().splitlines()
    return {k: v for k, v in numbers.items() if k != "error"} | ({"error": lines[-1][:300]} if lines else {})
