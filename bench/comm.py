"""Where a ZeRO step's communication falls, on 2 and 4 CPU ranks: during the backward, or after it.

    python bench/comm.py [--ranks 2,4] [--buckets 8] [--record]

stk-train's own step (bench/overhead.stk_step: the narrow SDXL UNet at its published depth, full fine-tune, bf16)
under mpiexec, for zero1 and zero2 with overlap_comm off and on, the buckets cut so that the gradients fill
--buckets of them. One steady step of rank 0 is traced by torch.profiler: each collective gloo ran (its `gloo:`
range, where the work is) against the backward's span (the first and last autograd op). What it prints per run:
the collectives and their seconds, and the share of those seconds spent inside the backward's span, which is what
overlap_comm can hide behind compute on a GPU. On the CPU gloo's collectives run inline on the calling thread
(DeepSpeed's CPU accelerator has no streams), so the step's time is compute plus communication either way: the
trace shows where the work falls, not a saving.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import WARM_UP_STEPS, cached_batch, narrow_model, record, stk_step

RUNS = (("zero1", False), ("zero1", True), ("zero2", False), ("zero2", True))  # (preset, overlap_comm)
COLLECTIVES = ("reduce", "gather", "broadcast")  # within gloo's range names: all_reduce, reduce_scatter, all_gather


def child(model: str, preset: str, overlap: bool, bucket: int) -> dict[str, Any] | None:
    """One rank of the run: three warm-up steps, one traced; rank 0's row."""
    from torch.profiler import ProfilerActivity, profile

    from stk.cluster.world import get_world
    from stk.train.deepspeed.distributed import init_distributed, resolve_dist_env

    torch.set_num_threads(1)
    world = get_world()
    init_distributed(resolve_dist_env(world, os.environ), backend="gloo")
    batch = cached_batch("sdxl", model, 64)
    zero = {"overlap_comm": overlap, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    step = stk_step("sdxl", model, "full", preset, batch, zero)
    for n in range(WARM_UP_STEPS + 1):
        step(n)
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as traced:
        step(WARM_UP_STEPS + 1)
    seconds = time.perf_counter() - started
    torch.distributed.destroy_process_group()
    if world.rank != 0:
        return None
    run = {"preset": preset, "overlap_comm": overlap, "bucket": bucket, "ranks": world.size, "step_s": seconds}
    return run | where_comm_falls(traced.events())


def where_comm_falls(events: Any) -> dict[str, Any]:
    """The collectives of a traced step, their seconds, and the share of those inside the backward's span."""
    backward = [e.time_range for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    comm = [e for e in events if e.name.startswith("gloo:") and any(c in e.name for c in COLLECTIVES)]
    start, end = min(r.start for r in backward), max(r.end for r in backward)
    total = sum(e.time_range.elapsed_us() for e in comm)
    inside = sum(max(0, min(e.time_range.end, end) - max(e.time_range.start, start)) for e in comm)
    share = round(inside / total, 3) if total else None
    return {"collectives": dict(Counter(e.name for e in comm)), "comm_s": round(total / 1e6, 4), "in_backward": share}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    header = "| ranks | preset | overlap_comm | bucket | step s | comm s | comm in the backward | collectives |"
    lines = [f"`{command}`", "", header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{name} x{n}" for name, n in r["collectives"].items())
        cells = [
            r["ranks"],
            r["preset"],
            r["overlap_comm"],
            f"{r['bucket']:,}",
            f"{r['step_s']:.3f}",
            f"{r['comm_s']:.3f}",
            f"{r['in_backward']:.0%}",
            kinds,
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--buckets", type=int, default=8, help="the gradients cut into about this many buckets")
    parser.add_argument("--record", action="store_true", help="put the table into bench/RESULTS.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        row = child(spec["model"], spec["preset"], spec["overlap"], spec["bucket"])
        if row is not None:
            print(json.dumps(row), flush=True)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model = narrow_model("sdxl", Path(scratch) / "sdxl")
        from diffusers import UNet2DConditionModel

        weights = sum(p.numel() for p in UNet2DConditionModel.from_pretrained(model, subfolder="unet").parameters())
        bucket = -(-weights // args.buckets // 1024) * 1024  # DeepSpeed wants a multiple of its alignment
        for ranks in map(int, args.ranks.split(",")):
            for preset, overlap in RUNS:
                spec = json.dumps({"model": model, "preset": preset, "overlap": overlap, "bucket": bucket})
                command = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--child", spec]
                out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=env).stdout
                for line in out.splitlines():
                    if line.startswith("{"):
                        rows.append(json.loads(line))
                        print(line, flush=True)
    table = markdown(rows, "python bench/comm.py " + " ".join(sys.argv[1:]))
    print(table)
    if args.record:
        title = f"## Where a ZeRO step's communication falls, 2 and 4 CPU ranks ({time.strftime('%Y-%m-%d')})"
        record(f"{title}\n\n{table}")


if __name__ == "__main__":
    main()
