"""The work stk-train's step dispatches, counted as bench/overhead.py counts it (ops that reach a kernel, below
autograd): on the SDXL UNet at its published depth (70 transformer blocks, 1,120 LoRA tensors) but narrow widths,
stk's step under ZeRO-2 against the diffusers examples' own loops. Counts, not time: the same on any machine."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def bench_overhead() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_overhead", REPO / "bench" / "overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_overhead", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("variant", "preset"), [("lora", "zero2"), ("full", "zero1")])
def test_the_step_dispatches_no_more_than_the_bench_s_ratio_over_the_plain_loop(
    variant: str, preset: str, one_rank, tmp_path: Path
) -> None:
    bench = bench_overhead()
    model = bench.narrow_model("sdxl", tmp_path / "sdxl")
    batch = bench.cached_batch("sdxl", model, 64)
    with torch.random.fork_rng():
        plain = bench.count_step(bench.plain_step("sdxl", model, variant, batch))
        stk = bench.count_step(bench.stk_step("sdxl", model, variant, preset, batch))

    unet = json.loads((Path(model) / "unet" / "config.json").read_text())
    assert unet["transformer_layers_per_block"] == [1, 2, 10]  # the published depth: every tensor a real run has
    target = bench.TARGETS[(variant, preset == "zero3")]
    assert stk.ops <= target * plain.ops, f"{stk.ops} ops, {stk.ops / plain.ops:.3f}x the plain loop's {plain.ops}"
