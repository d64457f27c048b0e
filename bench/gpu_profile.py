"""bench/gpu.py's profile part: where one stk-train step's time goes, measured inside stk-train itself.

The first GPU run found stk-train's SDXL step 0.45 s longer than the UNet's forward and backward, whatever the ZeRO
stage and whatever trained (bench/RESULTS-archive.md, "The GPU proof kit"). This part runs stk-train (LoRA rank 16,
checkpointing, ZeRO-2, bf16) in a process whose step loop is wrapped: each optimizer step's `train_step` and step
boundary are timed (the step ends in `float(loss)`, so `train_step` includes the GPU's work) and labelled for
torch.profiler, which records a few steps after the warm-up; cProfile then records a few more. What it writes to
--profile-dir: `ops.txt` (torch.profiler's operator tables by CPU and by device time), `python.txt` (cProfile's
functions by cumulative time) and `trace.json.gz` (the profiler's timeline, for Perfetto). Its row holds the
split's medians and the GPU-busy share: of the profiled steps' wall time, the share in which a kernel ran (the union
of the kernels' intervals, so that streams running at once count once); with --compile the step is compiled, where
the target is 90%.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import pstats
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_setup import Scale, run, train_args

WARMUP_STEPS = 2  # left out of the medians, with the steps either profiler records
BUSY_TARGET = 0.9  # of the compiled step at batch 4, 1024 px (issue 37)
SCRIPT = str(Path(__file__).resolve())


def steps_for(scale: Scale) -> tuple[int, int, int]:
    """(the first step torch.profiler records, how many steps it and then cProfile record, the run's steps)."""
    return (3, 1, 6) if scale.cpu else (7, 3, 15)


def part_profile(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    batch = scale.batch_sizes[0]
    first, count, steps = steps_for(scale)
    out, folder = work / "train-profile", Path(args.profile_dir or work / "profile")
    shutil.rmtree(out, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    compiled = ["--compile", "default"] if args.compile else []
    train = [*train_args(scale, work, "sdxl", out, batch, "lora-ckpt", steps), *compiled]
    command = [sys.executable, SCRIPT, "--profile-dir", str(folder), "--first", str(first), "--count", str(count)]
    ran = run([*command, "--", *map(str, train)], scale, check=False)
    if ran.code != 0:
        raise SystemExit(f"profiled stk-train failed ({ran.code}):\n{ran.stderr[-3000:]}")
    split = json.loads((folder / "split.json").read_text())
    busy = split["gpu_busy_share"]
    yield {
        "part": "profile",
        "variant": "lora-ckpt",
        "batch": batch,
        "compiled": bool(compiled),
        "samples_per_s": None,
        "peak_memory": None,
        "mfu": None,
        "baseline_ratio": None,
        **split,
        "files": str(folder),
        "busy_target": BUSY_TARGET,
        "ok": busy >= BUSY_TARGET if compiled and busy is not None else None,
    }


def profiled_train(folder: Path, first: int, count: int, train_args: list[str]) -> None:
    """stk-train with its step loop wrapped; writes split.json: the medians of the split, in seconds."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    import stk.train.loop as loop
    from stk.cli import train as train_cli

    step_fn, boundary_fn = loop.train_step, loop._step_boundary
    timings: dict[str, list[float]] = {"train_step_s": [], "boundary_s": []}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(
        activities=activities,
        schedule=schedule(wait=first - 2, warmup=1, active=count, repeat=1),
        on_trace_ready=lambda p: busy.append(write_profile(p, folder, count)),
    )
    python = cProfile.Profile()
    busy: list[float | None] = []

    def step(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        with record_function("stk.train_step"):
            result = step_fn(*a, **k)
        timings["train_step_s"].append(time.perf_counter() - started)
        return result

    def boundary(run: Any, *a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        with record_function("stk.step_boundary"):
            outcome = boundary_fn(run, *a, **k)
        timings["boundary_s"].append(time.perf_counter() - started)
        profiler.step()
        if run.step == first + count - 1:  # the steps after the profiler's are cProfile's
            python.enable()
        elif run.step == first + 2 * count - 1:
            python.disable()
            with (folder / "python.txt").open("w") as f:
                pstats.Stats(python, stream=f).sort_stats("cumulative").print_stats(60)
        return outcome

    loop.train_step, loop._step_boundary = step, boundary
    sys.argv = ["stk-train", *train_args]
    try:
        with profiler:
            train_cli.entry()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    quiet = [
        i for i in range(len(timings["boundary_s"])) if WARMUP_STEPS <= i < first - 1 or i >= first + 2 * count - 1
    ]
    split = {name: round(statistics.median(values[i] for i in quiet), 4) for name, values in timings.items()}
    split["profiled_steps"] = [first, first + count - 1]
    split["gpu_busy_share"] = busy[0] if busy else None
    (folder / "split.json").write_text(json.dumps(split))  # stk-train keeps stdout for its summary line


def write_profile(profiler: Any, folder: Path, steps: int) -> float | None:
    """The operator tables and the timeline of the profiled steps; their GPU-busy share (None without a GPU)."""
    averages = profiler.key_averages()
    device = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with (folder / "ops.txt").open("w") as f:
        for key in ("cpu_time_total", "self_cpu_time_total", device):
            f.write(
                f"== {steps} steps, by {key}\n{averages.table(sort_by=key, row_limit=40, max_name_column_width=70)}\n"
            )
    trace = folder / "trace.json"
    profiler.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    return busy_share(profiler.events())


def busy_share(events: Any) -> float | None:
    """Of the profiled steps' wall time (torch.profiler's ProfilerStep ranges, first start to last end), the share
    covered by GPU kernels, each instant counted once whatever number of kernels ran in it."""
    from torch.autograd import DeviceType

    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep#")]
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not steps or not kernels:
        return None
    start, end = min(s for s, _ in steps), max(e for _, e in steps)
    covered, reached = 0, start
    for begin, finish in kernels:
        begin, finish = max(begin, reached), min(finish, end)
        if finish > begin:
            covered += finish - begin
            reached = finish
    return round(covered / (end - start), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description="stk-train with its step loop profiled (bench/gpu.py --only profile)")
    parser.add_argument("--profile-dir", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    profiled_train(Path(args.profile_dir), args.first, args.count, train_args)


if __name__ == "__main__":
    main()
