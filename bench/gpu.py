"""The GPU proof kit: everything a GPU can prove about stk, in parts that each fit in 10 minutes, against the loops
users run today, with random weights from the published configs (no hub access).

    python bench/gpu.py [--only PART[,PART...]] [--record] [--workdir DIR] [--compile]
                        [--batch-sizes 4,8] [--variants full-ckpt,...] [--flux-blocks 4,8] [--cpu]

Parts (in the order `make gpu-check` runs them):

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
  breaker  a fixed GPU workload with stk's circuit breaker polling the real NVML every second, against none,
           alternating: overhead in % (target < 0.1%).
  oom      stk-train with a batch far too big for the device: exit 3 with one line within seconds, no traceback,
           no hang.

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
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

PARTS = ("health", "cache", "train", "flux", "breaker", "oom")
VARIANTS = ("full-ckpt", "full", "lora-ckpt", "lora")  # full or LoRA rank 16, gradient checkpointing on or off
KEYS = ("samples_per_s", "peak_memory", "mfu", "baseline_ratio")
TARGETS = {"health_s": 1.0, "baseline_ratio": 1.0, "baseline_ratio_compiled": 1.2, "breaker_pct": 0.1,
           "flux_s_per_step": 7.5, "oom_s": 120.0}  # fmt: skip
REFERENCE_FLUX_S_PER_STEP = 15.0  # the reference guide's Flux.1-dev full fine-tune, 32 GPUs, batch 8 per GPU
FLUX_GPUS, FLUX_BATCH = 32, 8
LORA_RANK = 16
WARMUP_STEPS = 2  # first steps (allocation, autotuning, compilation) left out of step times
# Dense bf16 tensor-core peaks in TFLOPS (no sparsity), from the vendors' data sheets; the first name that the device
# name contains wins, so the specific names come first. --peak-tflops overrides.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0), ("A10G", 70.0), ("RTX 4090", 165.2),
)  # fmt: skip
PYTHON = sys.executable
REPO = Path(__file__).resolve().parent.parent
CAPTION_WORDS = ("a", "photo", "of", "the", "red", "cat", "on", "blue", "painting", "dog", "with", "man")

# The tiny shapes of --cpu: the published configs with small widths (the code path is the same).
# a wide first block (the published VAE's 128 channels): oom's first activation outgrows the address space at 16
# images of 1024 px
TINY_VAE = {"block_out_channels": [128, 64, 64, 64], "layers_per_block": 1}
TINY_SDXL = {"block_out_channels": [32, 64, 64], "attention_head_dim": [2, 4, 4], "layers_per_block": 1,
             "transformer_layers_per_block": [1, 1, 1], "cross_attention_dim": 96, "addition_time_embed_dim": 8,
             "projection_class_embeddings_input_dim": 112}  # fmt: skip
TINY_FLUX = {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
             "joint_attention_dim": 48, "pooled_projection_dim": 32, "axes_dims_rope": [4, 6, 6]}  # fmt: skip


@dataclass(frozen=True)
class Scale:
    """The sizes one run of the kit works at."""

    device: str
    resolution: int
    images: int
    steps: int
    batch_sizes: tuple[int, ...]
    variants: tuple[str, ...]
    flux_blocks: tuple[int, int]
    flux_batch: int
    oom_batch: int
    sdxl: dict[str, Any] = field(default_factory=dict)  # overrides of the published configs
    flux: dict[str, Any] = field(default_factory=dict)
    vae: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


GPU = Scale("cuda", 1024, 64, 12, (4, 8), VARIANTS, (4, 8), 2, 64)
CPU = Scale("cpu", 64, 8, 3, (2,), ("lora",), (1, 1), 2, 16, TINY_SDXL, TINY_FLUX, TINY_VAE)


# ------------------------------------------------------------------------------------------------ processes


def child_env(scale: Scale) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if scale.cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float


def run(command: list[str], scale: Scale, check: bool = True, limit_bytes: int | None = None, **extra_env: str) -> Ran:
    """Run a command (an stk CLI as `-m module`), timed; `limit_bytes` caps its address space."""

    def cap() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = {**child_env(scale), **extra_env}
    if limit_bytes is not None:
        env["MALLOC_ARENA_MAX"] = "2"  # one arena per thread would reserve address space by the GiB
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=cap)
    ran = Ran(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - started)
    if check and ran.code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({ran.code}):\n{ran.stderr[-3000:]}")
    return ran


def stk(command: str, *args: Any) -> list[str]:
    return [PYTHON, "-m", f"stk.cli.{command}", *map(str, args)]


def last_json(text: str) -> dict[str, Any]:
    return next(json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{"))


# ------------------------------------------------------------------------------------------------ inputs


def images(scale: Scale, work: Path, name: str = "images", resolution: int | None = None, count: int | None = None):
    """Generated JPEGs with captions, every one resolution x resolution (one bucket), made once."""
    from stk.datagen import make_image

    root = work / name
    if not root.exists():
        side, count = resolution or scale.resolution, count or scale.images
        staging = work / f"{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for i in range(count):
            make_image(side, side, seed=i).save(staging / f"{i:05d}.jpg", quality=90)
            words = [CAPTION_WORDS[(i * 7 + k) % len(CAPTION_WORDS)] for k in range(3 + i % 5)]
            (staging / f"{i:05d}.txt").write_text(" ".join(words))
        staging.rename(root)
    return root


def scanned(scale: Scale, work: Path, name: str = "images", resolution: int | None = None, count: int | None = None):
    root = images(scale, work, name, resolution, count)
    out = work / f"scan-{name}"
    if not (out / "metadata.parquet").exists():
        run(stk("scan", root, "--out", out, "--resolution", resolution or scale.resolution, "--alignment", 64,
                "--batch-size", 1, "--gpus", 1, "--allow-oversubscription", "-q"), scale)  # fmt: skip
    return out


def model(scale: Scale, work: Path, name: str) -> str:
    """A pipeline with `name`'s published denoiser and VAE (changed as the scale says), random bf16 weights."""
    from stk.models.tiny import build_published_model

    out = work / f"model-{name}"
    if not (out / "model_index.json").exists():
        overrides = scale.sdxl if name == "sdxl" else {**scale.flux, **flux_depth(scale.flux_blocks)}
        device = "cuda" if not scale.cpu else "cpu"  # a GPU draws billions of random weights in seconds
        build_published_model(name, str(out), device=device, denoiser=overrides, vae=scale.vae)
    return str(out)


def flux_depth(blocks: tuple[int, int]) -> dict[str, int]:
    return {"num_layers": blocks[0], "num_single_layers": blocks[1]}


def cached(scale: Scale, work: Path, name: str) -> Path:
    out = work / f"cache-{name}"
    if not (out / "manifest.json").exists():
        run(stk("cache", scanned(scale, work), "--model", model(scale, work, name), "--out", out, "-q"), scale)
    return out


# ------------------------------------------------------------------------------------------------ FLOPs, MFU


def peak_tflops(override: float | None) -> tuple[float | None, str]:
    """The device's dense bf16 peak and its name."""
    if not torch.cuda.is_available():
        return override, "cpu"
    name = torch.cuda.get_device_name()
    if override is not None:
        return override, name
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None), name


def step_inputs(batch: Any, norm: Any, device: Any, dtype: torch.dtype):
    """A cached batch as the objective takes it: the latent mean normalised (stk-train draws a sample)."""
    from stk.train.batch import StepInputs

    return StepInputs(
        latents=norm.normalize(batch.mean).to(device, dtype),
        text={name: value.to(device, dtype) for name, value in batch.text.items()},
        original_size=batch.original_size.to(device),
        crop_top_left=batch.crop_top_left.to(device),
    )


def cached_batch(cache: Path, size: int) -> Any:
    """The first `size` samples of the cache's largest bucket: the shapes stk-train trains on."""
    from stk.train.data import CacheData

    with CacheData(str(cache)) as data:
        keys = max(data.buckets().values(), key=len)
        if len(keys) < size:
            raise SystemExit(f"{cache}: {len(keys)} samples in its largest bucket, fewer than a batch of {size}")
        return data.load(keys[:size]), data.config.norm


def step_flops(model_dir: str, cache: Path, batch_size: int, denoiser_overrides: dict[str, Any] | None = None) -> int:
    """Forward + backward FLOPs of one training step of the denoiser on a cached batch, counted by
    torch.utils.flop_counter on the meta device (no memory, any size); without checkpointing's recompute."""
    from torch.utils.flop_counter import FlopCounterMode

    from stk.models import detect_family
    from stk.models.published import build_published
    from stk.train.objectives import objective_for

    objective = objective_for(detect_family(model_dir), model_dir)
    config = {**objective.denoiser_config(), "_class_name": objective.denoiser_class.__name__,
              **(denoiser_overrides or {})}  # fmt: skip
    denoiser = build_published(config, "meta").to(torch.bfloat16)
    batch, norm = cached_batch(cache, batch_size)
    inputs = step_inputs(batch, norm, "meta", torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        objective.loss(denoiser, inputs, torch.Generator().manual_seed(0)).backward()
    return int(counter.get_total_flops())


def mfu(flops: int, seconds: float, peak: float | None) -> float | None:
    return round(flops / seconds / (peak * 1e12), 4) if peak and seconds > 0 else None


# ------------------------------------------------------------------------------------------------ parts


def result(part: str, **values: Any) -> dict[str, Any]:
    return {"part": part, **{key: None for key in KEYS}, **values}


def scripted_gpu(work: Path) -> str:
    """--cpu has no NVML: stk-health and the breaker read one healthy GPU from a script, through the interface
    they read NVML through (stk.health.devices)."""
    script = work / "gpus.json"
    gpu = {"index": 0, "uuid": "GPU-00000000", "name": "scripted", "temperature": 40, "shutdown_temperature": 92,
           "ecc_volatile_uncorrectable": 0}  # fmt: skip
    script.write_text(json.dumps([[gpu]]))
    return str(script)


def part_health(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    scripted = {"STK_HEALTH_SCRIPT": scripted_gpu(work)} if scale.cpu else {}
    interpreter = min(run([PYTHON, "-c", "pass"], scale).seconds for _ in range(3))
    checks = [run(stk("health", "check", "--format", "json"), scale, check=False, **scripted) for _ in range(3)]
    best = min(checks, key=lambda r: r.seconds)
    smi = run(["nvidia-smi", "-q"], scale, check=False).seconds if shutil.which("nvidia-smi") else None
    over = best.seconds - interpreter
    yield result(
        "health", exit_code=best.code, findings=[json.loads(line) for line in best.stdout.splitlines() if line],
        seconds=round(best.seconds, 3), seconds_over_interpreter=round(over, 3),
        nvidia_smi_seconds=smi and round(smi, 3),
        target_s=TARGETS["health_s"], ok=best.code in (0, 1) and over < TARGETS["health_s"],
        readings="scripted (--cpu)" if scripted else "nvml",
    )  # fmt: skip


def part_cache(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    out = work / "cache-sdxl"
    shutil.rmtree(out, ignore_errors=True)
    ran = run(stk("cache", scanned(scale, work), "--model", model(scale, work, "sdxl"), "--out", out, "-q"), scale)
    summary = last_json(ran.stdout)
    baseline = one_image_per_call(scale, work)
    ratio = summary["images_per_second"] / baseline
    yield result("cache", samples_per_s=summary["images_per_second"], baseline_samples_per_s=round(baseline, 3),
                 baseline_ratio=round(ratio, 3), images=summary["images"], seconds=summary["seconds"],
                 ok=ratio >= TARGETS["baseline_ratio"])  # fmt: skip


def one_image_per_call(scale: Scale, work: Path) -> float:
    """The seed trainer's cache loop: decode, fit to the bucket, encode, one image at a time."""
    from stk.models import load_encoders
    from stk.preprocess import CropMode, preprocess
    from stk.scan.reader import read_scan

    table = read_scan(str(scanned(scale, work)))
    encoders = load_encoders(model(scale, work, "sdxl"))
    rows = table.rows
    started = None
    for i, row in enumerate(rows):
        if i == min(2, len(rows) - 1):  # after a warm-up
            sync()
            started = time.perf_counter()
        with open(table.image_location(row["path"]), "rb") as f:
            pixels = preprocess(f, row["bucket_width"], row["bucket_height"], CropMode.CENTER, row["path"]).pixels
        encoders.encode_images(torch.from_numpy(pixels)[None])
    sync()
    assert started is not None
    return (len(rows) - min(2, len(rows) - 1)) / (time.perf_counter() - started)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_stk(scale: Scale, work: Path, name: str, batch: int, variant: str, extra: list[str]) -> dict[str, Any]:
    """One stk-train run: samples/s from its step times after the warm-up, and its peak GPU memory."""
    out = work / f"train-{name}-{variant}-b{batch}"
    shutil.rmtree(out, ignore_errors=True)
    flags = ["--lora-rank", LORA_RANK] if variant.startswith("lora") else []
    flags += [] if variant.endswith("ckpt") else ["--no-gradient-checkpointing"]
    ran = run(stk("train", "--cache", cached(scale, work, name), "--scan", scanned(scale, work), "--model",
                  model(scale, work, name), "--output-dir", out, "--max-steps", scale.steps, "--epochs", 1000,
                  "--batch-size", batch, "--deepspeed", "zero2", "--checkpoint-every", 0, "--resume", "none",
                  "--allow-oversubscription", "-q", *flags, *extra), scale, check=False)  # fmt: skip
    if ran.code != 0:
        line = (ran.stderr.strip().splitlines() or [""])[-1]
        if "out of GPU memory" in line or "out of host memory" in line:
            return {"oom": True, "error": line}
        raise SystemExit(f"stk-train {variant} batch {batch} failed ({ran.code}):\n{ran.stderr[-3000:]}")
    summary = last_json(ran.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows[WARMUP_STEPS:]] or [r["step_time"] for r in rows]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / "final", ignore_errors=True)
    return {"samples_per_s": round(batch / statistics.median(times), 3), "peak_memory": summary["peak_gpu_memory"],
            "step_s": round(statistics.median(times), 4)}  # fmt: skip


def baseline(scale: Scale, work: Path, name: str, batch: int, variant: str) -> dict[str, Any]:
    """The plain loop, in a process of its own (its own peak memory)."""
    spec = {"model": model(scale, work, name), "cache": str(cached(scale, work, name)), "batch": batch,
            "variant": variant, "steps": scale.steps}  # fmt: skip
    ran = run([PYTHON, __file__, "--baseline-child", json.dumps(spec)], scale, check=False)
    if ran.code != 0:
        raise SystemExit(f"baseline {variant} batch {batch} failed ({ran.code}):\n{ran.stderr[-3000:]}")
    return last_json(ran.stdout)


def baseline_child(spec: dict[str, Any]) -> dict[str, Any]:
    """diffusers' train_text_to_image_sdxl.py, reduced to its step: the UNet in fp32 (accelerate's mixed precision
    keeps fp32 weights), torch AdamW (lr 1e-5, its defaults), autocast bf16 on CUDA, the same loss (stk's objective
    is diffusers' loss), gradient checkpointing as asked, LoRA through peft's LoraConfig as
    train_text_to_image_lora_sdxl.py adds it. The same cached batch every step: no data loading at all."""
    from peft import LoraConfig

    from stk.models import detect_family
    from stk.train.objectives import objective_for

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = detect_family(spec["model"])
    objective = objective_for(family, spec["model"])
    denoiser = objective.denoiser_class.from_pretrained(spec["model"], subfolder=objective.denoiser_subfolder,
                                                        torch_dtype=torch.float32).to(device)  # fmt: skip
    if spec["variant"].endswith("ckpt"):
        denoiser.enable_gradient_checkpointing()
    if spec["variant"].startswith("lora"):
        denoiser.requires_grad_(False)
        denoiser.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
                                        target_modules=list(objective.spec.lora_targets)))  # fmt: skip
    denoiser.train()
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-2, fused=device.type == "cuda")
    batch, norm = cached_batch(Path(spec["cache"]), spec["batch"])
    inputs = step_inputs(batch, norm, device, torch.float32)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    try:
        for step in range(spec["steps"]):
            sync()
            started = time.perf_counter()
            with autocast:
                loss = objective.loss(denoiser, inputs, torch.Generator().manual_seed(step))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as exc:
        return {"oom": True, "error": str(exc).splitlines()[0]}
    step = statistics.median(times[WARMUP_STEPS:] or times)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"samples_per_s": round(spec["batch"] / step, 3), "peak_memory": peak, "step_s": round(step, 4)}


def part_train(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    peak, _ = peak_tflops(args.peak_tflops)
    extra = ["--compile", "default"] if args.compile else []
    target = TARGETS["baseline_ratio_compiled" if args.compile else "baseline_ratio"]
    sdxl, cache = model(scale, work, "sdxl"), cached(scale, work, "sdxl")
    for batch in scale.batch_sizes:
        flops = step_flops(sdxl, cache, batch)
        for variant in scale.variants:
            ours = train_stk(scale, work, "sdxl", batch, variant, extra)
            theirs = baseline(scale, work, "sdxl", batch, variant)
            ratio = None
            if not ours.get("oom") and not theirs.get("oom"):
                ratio = round(ours["samples_per_s"] / theirs["samples_per_s"], 3)
            yield result(
                "train", variant=variant, batch=batch, compiled=args.compile, **ours,
                mfu=None if ours.get("oom") else mfu(flops, ours["step_s"], peak), flops_per_step=flops,
                baseline_ratio=ratio, baseline={k: v for k, v in theirs.items() if k != "error"},
                target=target, ok=None if ratio is None else ratio >= target,
            )  # fmt: skip


def part_flux(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    peak, _ = peak_tflops(args.peak_tflops)
    flux, cache = model(scale, work, "flux-dev"), cached(scale, work, "flux-dev")
    ours = train_stk(scale, work, "flux-dev", scale.flux_batch, "full-ckpt", [])
    if ours.get("oom"):
        yield result("flux", blocks=list(scale.flux_blocks), batch=scale.flux_batch, **ours)
        return
    flops = step_flops(flux, cache, scale.flux_batch)
    rate = flops / ours["step_s"]  # FLOP/s this GPU reached
    # Flux.1-dev itself, at the reference run's batch, on the shapes this cache holds (only depth differs)
    full = step_flops(flux, cache, scale.flux_batch, {"num_layers": 19, "num_single_layers": 38}) * (
        FLUX_BATCH / scale.flux_batch
    )
    params = sum(p.numel() for p in build_flux_dev_meta().parameters())
    ring = 2 * (FLUX_GPUS - 1) / FLUX_GPUS * params * 2  # bytes each GPU sends in a ring all-reduce of bf16 grads
    allreduce_s = ring / (args.bus_gbps * 1e9)
    projected = full / rate + allreduce_s
    yield result(
        "flux", blocks=list(scale.flux_blocks), batch=scale.flux_batch, **ours, mfu=mfu(flops, ours["step_s"], peak),
        flops_per_step=flops, projection={
            "gpus": FLUX_GPUS, "batch_per_gpu": FLUX_BATCH, "compute_s": round(full / rate, 3),
            "allreduce_s": round(allreduce_s, 3), "bus_gbps": args.bus_gbps, "s_per_step": round(projected, 3),
            "mfu": mfu(int(full), projected, peak), "reference_s_per_step": REFERENCE_FLUX_S_PER_STEP,
            "goal_s_per_step": TARGETS["flux_s_per_step"],
        }, ok=projected <= TARGETS["flux_s_per_step"],
    )  # fmt: skip


def build_flux_dev_meta() -> torch.nn.Module:
    from stk.models.published import build_published, published_config

    return build_published(published_config("flux-dev", "denoiser"))


def part_breaker(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from stk.health.breaker import GpuWatch
    from stk.health.devices import ScriptedBackend

    backend = ScriptedBackend(scripted_gpu(work)) if scale.cpu else None
    device = torch.device("cuda" if not scale.cpu else "cpu")
    side = 256 if scale.cpu else 8192
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16 if not scale.cpu else torch.float32)

    def step() -> float:
        """A step-shaped workload: many kernel launches from Python, each waiting on the device."""
        sync()
        started = time.perf_counter()
        for _ in range(40):
            (a @ a).sum().item()
        return time.perf_counter() - started

    rounds, per_round = (3, 5) if scale.cpu else (10, 30)
    plain: list[float] = []
    watched: list[float] = []
    step()
    for _ in range(rounds):
        plain += [step() for _ in range(per_round)]
        with GpuWatch(0, interval=1.0, backend=backend) as watch:
            watched += [step() for _ in range(per_round)]
            active = watch.active
    overhead = (statistics.median(watched) / statistics.median(plain) - 1) * 100
    yield result("breaker", step_s=round(statistics.median(plain), 5),
                 watched_step_s=round(statistics.median(watched), 5), overhead_pct=round(overhead, 3),
                 watch_active=active, target_pct=TARGETS["breaker_pct"],
                 ok=active and overhead < TARGETS["breaker_pct"])  # fmt: skip


def part_oom(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """A batch that cannot fit: on a GPU, the SDXL UNet at 1024 px without checkpointing; on the CPU, a batch of
    1024 px images encoded on the fly under a 12 GiB address-space limit (the VAE's first activation alone is 8 GiB)."""
    if scale.cpu:
        scan = scanned(scale, work, "images-1024", resolution=1024, count=scale.oom_batch)
        data, limit = ["--scan", scan, "--vae-on-the-fly"], 12 << 30
    else:
        data, limit = ["--cache", cached(scale, work, "sdxl"), "--scan", scanned(scale, work)], None
    out = work / "train-oom"
    shutil.rmtree(out, ignore_errors=True)
    ran = run(stk("train", *data, "--model", model(scale, work, "sdxl"), "--output-dir", out, "--max-steps", 2,
                  "--batch-size", scale.oom_batch, "--no-gradient-checkpointing", "--checkpoint-every", 0,
                  "--resume", "none", "--prefetch", 1, "--allow-oversubscription", "-q"),
              scale, check=False, limit_bytes=limit)  # fmt: skip
    lines = ran.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    clear = ran.code == 3 and "Traceback" not in ran.stderr and "out of" in last and "memory" in last
    yield result("oom", exit_code=ran.code, expected_exit_code=3, seconds=round(ran.seconds, 1), line=last,
                 traceback="Traceback" in ran.stderr, ok=clear and ran.seconds < TARGETS["oom_s"])  # fmt: skip


PART_RUNNERS: dict[str, Callable[[Scale, Path, argparse.Namespace], Iterator[dict[str, Any]]]] = {
    "health": part_health, "cache": part_cache, "train": part_train, "flux": part_flux, "breaker": part_breaker,
    "oom": part_oom,
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ recording


def environment() -> dict[str, Any]:
    _, name = peak_tflops(None)
    driver = None
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {"device": name, "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda, "date": date,
            "host": platform.node()}  # fmt: skip


def record(path: Path, command: str, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Append the results as a table: one row per measurement, its other fields as JSON."""

    def cell(value: Any) -> str:
        return "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)

    lines = [
        "", f"### GPU proof kit: {env['device']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"{env['date']}", "", f"`{command}`", "",
        "| part | samples/s | peak memory (GiB) | MFU | baseline ratio | ok | details |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in results:
        peak = row["peak_memory"]
        rest = {k: v for k, v in row.items() if k not in ("part", "ok", *KEYS)}
        lines.append(f"| {row['part']} | {cell(row['samples_per_s'])} | {'' if peak is None else f'{peak / 2**30:.1f}'}"
                     f" | {cell(row['mfu'])} | {cell(row['baseline_ratio'])} | {cell(row.get('ok'))} | "
                     f"{cell(rest).replace('|', '/')} |")  # fmt: skip
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
    parser.add_argument("--compile", action="store_true", help="train: stk-train --compile default")
    parser.add_argument("--batch-sizes", type=parse_ints, default=None, help="train: per-GPU batch sizes [4,8]")
    parser.add_argument("--variants", default=None, help=f"train: comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--flux-blocks", type=parse_ints, default=None, help="flux: double,single blocks [4,8]")
    parser.add_argument("--flux-batch", type=int, default=None, help="flux: per-GPU batch [2]")
    parser.add_argument(
        "--bus-gbps",
        type=float,
        default=50.0,
        help="flux projection: all-reduce bus bandwidth per GPU, GB/s (8x400 Gb/s IB per node: 50)",
    )
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
    scale = replace(scale, variants=variants, batch_sizes=args.batch_sizes or scale.batch_sizes,
                    flux_blocks=args.flux_blocks or scale.flux_blocks,
                    flux_batch=args.flux_batch or scale.flux_batch)  # fmt: skip
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stk-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(json.dumps({"environment": env, "workdir": str(work)}), flush=True)
    results = []
    for part in parts:
        for row in PART_RUNNERS[part](scale, work, args):
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.record:
        record(Path(args.results), " ".join(["python bench/gpu.py", *sys.argv[1:]]), env, results)


if __name__ == "__main__":
    main()
