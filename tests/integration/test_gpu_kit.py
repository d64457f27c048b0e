"""bench/gpu.py, the GPU proof kit, in its --cpu smoke mode: every part runs on tiny shapes through the code a GPU
runs (stk's real CLIs, DeepSpeed engines on the CPU, the baseline loop in a process of its own, the breaker on a
scripted GPU behind stk's device interface, a batch the address space cannot hold), prints the keys the GPU run
records, and --record writes its table; fp8 is reported unavailable on the CPU. Its numbers mean nothing; its keys,
exit codes and arithmetic do."""

from __future__ import annotations

import gzip
import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.commands import REPO, train_env

pytestmark = pytest.mark.integration

KIT = REPO / "bench" / "gpu.py"
KEYS = ("samples_per_s", "peak_memory", "mfu", "baseline_ratio")


def load_kit_module(name: str) -> Any:
    """A module of the kit (bench/NAME.py), imported as `python bench/gpu.py` imports its parts: from bench/."""
    if str(KIT.parent) not in sys.path:
        sys.path.insert(0, str(KIT.parent))
    return importlib.import_module(name)


# Two kit processes at once (the parts are independent; this halves the wait on two cores), each its own workdir
# and results file, as two calls on a lent machine would be.
HALVES = ("health,cache,train,breaker,profile", "speed,flux,families,oom,quant")


@dataclass
class Kit:
    rows: dict[str, list[dict[str, Any]]]  # part -> its rows, in the order printed
    tables: list[str]  # each half's results file
    work: Path  # the first half's workdir: the SDXL model and cache


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Kit:
    root = tmp_path_factory.mktemp("gpu-kit")
    procs = []
    for i, parts in enumerate(HALVES):
        results = root / f"RESULTS-{i}.md"
        results.write_text("# Benchmark results\n")
        command = [
            sys.executable,
            str(KIT),
            "--cpu",
            "--only",
            parts,
            "--record",
            "--results",
            str(results),
            "--workdir",
            str(root / f"work-{i}"),
            "--peak-tflops",
            "0.05",
        ]
        procs.append(
            (
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env()),
                results,
            )
        )
    rows: dict[str, list[dict[str, Any]]] = {}
    for proc, _ in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        printed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert "environment" in printed[0]
        for row in printed[1:]:
            rows.setdefault(row["part"], []).append(row)
    return Kit(rows, [results.read_text() for _, results in procs], root / "work-0")


def test_every_part_runs_and_prints_the_keys_the_gpu_run_records(kit):
    assert sorted(kit.rows) == sorted(",".join(HALVES).split(","))
    for part, rows in kit.rows.items():
        # --cpu runs one training variant; a GPU run all four per batch size (families: two per config)
        assert len(rows) == (len(families_expected()) if part == "families" else 1), part
        assert all(set(KEYS) <= set(row) for row in rows), rows


def test_health_reads_the_gpu_and_is_timed_against_the_interpreter(kit):
    (health,) = kit.rows["health"]
    assert health["exit_code"] == 0 and health["ok"] is True
    (summary,) = [f for f in health["findings"] if f.get("summary")]
    assert summary["gpus"] == 1 and summary["severity"] == "OK"
    assert 0 < health["seconds_over_interpreter"] < health["seconds"]


def test_cache_and_train_are_measured_against_their_baselines(kit):
    (cache,) = kit.rows["cache"]
    assert cache["images"] == 8 and cache["samples_per_s"] > 0
    assert cache["baseline_ratio"] == pytest.approx(cache["samples_per_s"] / cache["baseline_samples_per_s"], rel=1e-2)
    (train,) = kit.rows["train"]
    assert train["variant"] == "lora" and train["batch"] == 2 and train["flops_per_step"] > 0
    assert train["samples_per_s"] > 0 and train["baseline"]["samples_per_s"] > 0
    assert train["baseline_ratio"] == pytest.approx(
        train["samples_per_s"] / train["baseline"]["samples_per_s"], rel=1e-2
    )
    assert train["mfu"] == pytest.approx(train["flops_per_step"] / train["step_s"] / 0.05e12, rel=1e-2)


def test_flops_are_counted_per_sample_of_the_batch(kit):
    gpu = load_kit_module("gpu_setup")
    model, cache = str(kit.work / "model-sdxl"), kit.work / "cache-sdxl"
    one, two = gpu.step_flops(model, cache, 1), gpu.step_flops(model, cache, 2)
    assert two == pytest.approx(2 * one, rel=0.01) and one > 0


def test_flux_projects_the_full_model_from_the_measured_rate(kit):
    (flux,) = kit.rows["flux"]
    assert flux["blocks"] == [1, 1] and flux["samples_per_s"] > 0 and flux["mfu"] > 0
    projection = flux["projection"]
    assert projection["gpus"] == 32 and projection["batch_per_gpu"] == 8
    assert projection["s_per_step"] == pytest.approx(projection["compute_s"] + projection["comm_s"], abs=2e-3)
    # FLUX.1-dev's 11.9B bf16 gradients reduce-scattered over 32 GPUs at 50 GB/s in buckets of 5e7 (the zero2
    # preset's), the last bucket's exposed; the updated weights all-gathered after the step, all exposed; 0.3 ms a
    # collective
    weights, bucket, share, latency = 11_901_408_320, 50_000_000, 31 / 32, 3e-4
    reduce_tail = latency + share * bucket * 2 / 50e9
    gather = 239 * latency + share * weights * 2 / 50e9
    assert projection["comm_s"] == pytest.approx(reduce_tail + gather, rel=1e-3)


def families_expected() -> list[str]:
    """On the CPU the last published flow config but FLUX.1's (the kit's code is the same for each)."""
    from stk.models.families import spec_for
    from stk.models.published import PUBLISHED

    return [name for name, family in PUBLISHED.items() if spec_for(family).denoiser.flow and name != "flux-dev"][-1:]


def test_families_train_each_published_config_and_project_it(kit):
    rows = kit.rows["families"]
    (expected,) = families_expected()
    assert [row["config"] for row in rows] == [expected] and expected != "flux-dev"
    denoisers = load_kit_module("denoisers")
    for row in rows:
        assert row["variant"] == "lora-ckpt" and row["batch"] == 2 and row["samples_per_s"] > 0
        # --cpu: the fewest blocks per block list that hold one of each kind
        measured = denoisers.denoiser_of(row["config"]).measured_blocks
        assert row["blocks"] == dict.fromkeys(denoisers.full_depth(row["config"]), measured)
        assert row["mfu"] == pytest.approx(row["flops_per_step"] / row["step_s"] / 0.05e12, rel=1e-2)
        projection = row["projection"]
        assert projection["gpus"] == 32 and projection["batch_per_gpu"] == 8
        assert projection["s_per_step"] == pytest.approx(projection["compute_s"] + projection["comm_s"], abs=2e-3)
        # the full depth costs more than the measured one: the projection scales the FLOPs up
        assert projection["compute_s"] > row["step_s"] * 8 / 2


def test_the_breaker_polls_while_the_workload_runs(kit):
    (breaker,) = kit.rows["breaker"]
    assert breaker["watch_active"] is True and breaker["step_s"] > 0
    assert isinstance(breaker["overhead_pct"], float)


def test_a_batch_too_big_is_one_line_and_exit_3(kit):
    (oom,) = kit.rows["oom"]
    assert oom["exit_code"] == 3 and oom["traceback"] is False and oom["ok"] is True
    assert "out of host memory at --batch-size 16" in oom["line"] and "--gradient-checkpointing" in oom["line"]


def test_fp8_is_reported_unavailable_where_the_device_has_none(kit):
    """--cpu: stk-train refuses --base-precision fp8 in one line naming the device, and the row says so; bf16 is not
    run for a ratio that cannot be had."""
    (quant,) = kit.rows["quant"]
    assert (
        quant["precision"] == "fp8"
        and quant["available"] is False
        and quant["ok"] is None
        and quant["samples_per_s"] is None
    )
    assert "--base-precision fp8 needs a GPU of compute capability 8.9" in quant["line"] and "(cpu)" in quant["line"]


def test_record_appends_a_table_headed_by_the_environment(kit):
    for parts, text in zip(HALVES, kit.tables, strict=True):
        assert text.startswith("# Benchmark results\n")
        assert "### GPU proof kit: cpu, driver None, torch " in text
        assert f"`python bench/gpu.py --cpu --only {parts} --record" in text
        table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| part")]
        recorded = [line.split(" | ")[0].removeprefix("| ") for line in table]
        assert list(dict.fromkeys(recorded)) == parts.split(",")


def test_unknown_parts_and_no_gpu_are_usage_errors(tmp_path):
    for args, message in ((["--cpu", "--only", "train,bake"], "--only bake: choose from"), ([], "no CUDA device")):
        proc = subprocess.run(
            [sys.executable, str(KIT), *args, "--workdir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=train_env(),
            timeout=120,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_profile_splits_the_step_and_writes_the_tables(kit):
    """The profiled run: the step's two halves timed, torch.profiler's operator tables naming them, cProfile's
    functions naming the step, and a timeline Perfetto reads (gzipped Chrome trace JSON)."""
    (profile,) = kit.rows["profile"]
    assert profile["train_step_s"] > 0 and profile["boundary_s"] > 0
    folder = Path(profile["files"])
    ops = (folder / "ops.txt").read_text()
    assert "stk.train_step" in ops and "stk.step_boundary" in ops
    assert "train_step" in (folder / "python.txt").read_text()
    with gzip.open(folder / "trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "stk.train_step" for e in events)


def test_speed_runs_the_plain_loop_stk_and_fp8_on_one_batch(kit):
    """--cpu: the plain loop, stk-train eager and with --fp8-matmuls (torch._scaled_mm runs on the CPU), each a
    process, their samples/s and the ratios the targets are set on; the compiled run is the GPU's alone."""
    (speed,) = kit.rows["speed"]
    runs = speed["runs"]
    assert set(runs) == {"plain", "eager", "fp8"} and speed["compiled"] is False
    assert all(run["samples_per_s"] > 0 for run in runs.values()), runs
    assert speed["eager_vs_plain"] == round(runs["eager"]["samples_per_s"] / runs["plain"]["samples_per_s"], 3)
    assert speed["fp8_vs_bf16"] == round(runs["fp8"]["samples_per_s"] / runs["eager"]["samples_per_s"], 3)
    assert speed["compiled_vs_eager"] is None and speed["targets"]["compiled_vs_eager"] == 1.25
    assert speed["ok"] == (speed["eager_vs_plain"] >= 1.0 and speed["fp8_vs_bf16"] >= 1.2)


def test_the_gpu_busy_share_counts_each_instant_once():
    """Kernels on two streams at once count once; time outside the profiled steps is not counted. Events as
    torch.profiler gives them (name, time_range, device_type): no GPU here to profile."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name: str, start: int, end: int, device: DeviceType) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)

    steps = [event("ProfilerStep#7", 100, 200, DeviceType.CPU), event("ProfilerStep#8", 200, 300, DeviceType.CPU)]
    kernels = [event("gemm", 90, 150, DeviceType.CUDA), event("gemm", 120, 160, DeviceType.CUDA)]
    kernels += [event("copy", 250, 260, DeviceType.CUDA), event("late", 290, 400, DeviceType.CUDA)]
    events = steps + kernels
    # covered: 100-160 (60), 250-260 (10), 290-300 (10) of 200
    assert load_kit_module("gpu_profile").busy_share(events) == 0.4
    assert load_kit_module("gpu_profile").busy_share(events[:2]) is None  # no GPU kernels: no share
