"""The parts of bench/gpu.py, each a generator of result rows: health, cache, train (against a plain diffusers
baseline), flux, families, breaker, oom and quant."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from denoisers import flow_configs, full_depth, reduced_depth
from gpu_setup import (
    KEYS,
    LORA_RANK,
    PYTHON,
    Scale,
    cached,
    cached_batch,
    last_json,
    mfu,
    model,
    peak_tflops,
    run,
    scanned,
    step_flops,
    step_inputs,
    stk,
    train_args,
)
from projection import Fabric, zero_comm

from stk.train.deepspeed.config import load_deepspeed_config

TARGETS = {
    "health_s": 1.0,
    "baseline_ratio": 1.0,
    "baseline_ratio_compiled": 1.2,
    "breaker_pct": 0.1,
    "flux_s_per_step": 7.5,
    "oom_s": 120.0,
    "fp8_ratio": 1.2,
    "compiled_ratio": 1.25,
}
REFERENCE_FLUX_S_PER_STEP = 15.0  # the reference guide's Flux.1-dev full fine-tune, 32 GPUs, batch 8 per GPU
FLUX_GPUS, FLUX_BATCH = 32, 8
SCRIPT = str(Path(__file__).with_name("gpu.py"))  # its --baseline-child runs baseline_child()
WARMUP_STEPS = 2  # first steps (allocation, autotuning, compilation) left out of step times


def result(part: str, **values: Any) -> dict[str, Any]:
    return {"part": part, **{key: None for key in KEYS}, **values}


def scripted_gpu(work: Path) -> str:
    """--cpu has no NVML: stk-health and the breaker read one healthy GPU from a script, through the interface
    they read NVML through (stk.health.devices)."""
    script = work / "gpus.json"
    gpu = {
        "index": 0,
        "uuid": "GPU-00000000",
        "name": "scripted",
        "temperature": 40,
        "shutdown_temperature": 92,
        "ecc_volatile_uncorrectable": 0,
    }
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
        "health",
        exit_code=best.code,
        findings=[json.loads(line) for line in best.stdout.splitlines() if line],
        seconds=round(best.seconds, 3),
        seconds_over_interpreter=round(over, 3),
        nvidia_smi_seconds=smi and round(smi, 3),
        target_s=TARGETS["health_s"],
        ok=best.code in (0, 1) and over < TARGETS["health_s"],
        readings="scripted (--cpu)" if scripted else "nvml",
    )


def part_cache(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    out = work / "cache-sdxl"
    shutil.rmtree(out, ignore_errors=True)
    ran = run(stk("cache", scanned(scale, work), "--model", model(scale, work, "sdxl"), "--out", out, "-q"), scale)
    summary = last_json(ran.stdout)
    baseline = one_image_per_call(scale, work)
    ratio = summary["images_per_second"] / baseline
    yield result(
        "cache",
        samples_per_s=summary["images_per_second"],
        baseline_samples_per_s=round(baseline, 3),
        baseline_ratio=round(ratio, 3),
        images=summary["images"],
        seconds=summary["seconds"],
        ok=ratio >= TARGETS["baseline_ratio"],
    )


def one_image_per_call(scale: Scale, work: Path) -> float:
    """The seed trainer's cache loop: decode, fit to the bucket, encode, one image at a time."""
    from stk.images.preprocess import CropMode, preprocess
    from stk.models import load_encoders
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


def train_stk(
    scale: Scale, work: Path, name: str, batch: int, variant: str, extra: list[str], refusable: bool = False
) -> dict[str, Any]:
    """One stk-train run: samples/s from its step times after the warm-up, and its peak GPU memory. With `refusable`,
    a run that fails is a result: {"refused": its line} when refused as set up (exit 3), else {"failed": its exit
    code, "error": the end of its log}, so that the part's other rows are still measured."""
    out = work / f"train-{name}-{variant}-b{batch}"
    shutil.rmtree(out, ignore_errors=True)
    ran = run(
        stk("train", *train_args(scale, work, name, out, batch, variant, scale.steps), *extra), scale, check=False
    )
    if ran.code != 0:
        line = (ran.stderr.strip().splitlines() or [""])[-1]
        if "out of GPU memory" in line or "out of host memory" in line:
            return {"oom": True, "error": line}
        if refusable and ran.code == 3:
            return {"refused": line}
        if refusable:
            return {"failed": ran.code, "error": ran.stderr[-1500:]}
        raise SystemExit(f"stk-train {variant} batch {batch} failed ({ran.code}):\n{ran.stderr[-3000:]}")
    summary = last_json(ran.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows[WARMUP_STEPS:]] or [r["step_time"] for r in rows]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / "final", ignore_errors=True)
    return {
        "samples_per_s": round(batch / statistics.median(times), 3),
        "peak_memory": summary["peak_gpu_memory"],
        "step_s": round(statistics.median(times), 4),
    }


def baseline(scale: Scale, work: Path, name: str, batch: int, variant: str) -> dict[str, Any]:
    """The plain loop, in a process of its own (its own peak memory)."""
    spec = {
        "model": model(scale, work, name),
        "cache": str(cached(scale, work, name)),
        "batch": batch,
        "variant": variant,
        "steps": scale.steps,
    }
    ran = run([PYTHON, SCRIPT, "--baseline-child", json.dumps(spec)], scale, check=False)
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
    from stk.train.objective.objectives import objective_for

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = detect_family(spec["model"])
    objective = objective_for(family, spec["model"])
    denoiser = objective.denoiser_class.from_pretrained(
        spec["model"], subfolder=objective.denoiser_subfolder, torch_dtype=torch.float32
    ).to(device)
    if spec["variant"].endswith("ckpt"):
        denoiser.enable_gradient_checkpointing()
    if spec["variant"].startswith("lora"):
        denoiser.requires_grad_(False)
        denoiser.add_adapter(
            LoraConfig(
                r=LORA_RANK,
                lora_alpha=LORA_RANK,
                init_lora_weights="gaussian",
                target_modules=list(objective.spec.denoiser.lora_targets),
            )
        )
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
                "train",
                variant=variant,
                batch=batch,
                compiled=args.compile,
                **ours,
                mfu=None if ours.get("oom") else mfu(flops, ours["step_s"], peak),
                flops_per_step=flops,
                baseline_ratio=ratio,
                baseline={k: v for k, v in theirs.items() if k != "error"},
                target=target,
                ok=None if ratio is None else ratio >= target,
            )


def part_flux(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    peak, _ = peak_tflops(args.peak_tflops)
    ours = train_stk(scale, work, "flux-dev", scale.flux_batch, "full-ckpt", [])
    if ours.get("oom"):
        yield result("flux", blocks=list(scale.flux_blocks), batch=scale.flux_batch, **ours)
        return
    flops, projection = project(scale, work, "flux-dev", "full-ckpt", ours["step_s"], args)
    yield result(
        "flux",
        blocks=list(scale.flux_blocks),
        batch=scale.flux_batch,
        **ours,
        mfu=mfu(flops, ours["step_s"], peak),
        flops_per_step=flops,
        projection={
            **projection,
            "reference_s_per_step": REFERENCE_FLUX_S_PER_STEP,
            "goal_s_per_step": TARGETS["flux_s_per_step"],
        },
        ok=projection["s_per_step"] <= TARGETS["flux_s_per_step"],
    )


def family_configs(scale: Scale) -> list[str]:
    """The flow families' published configs that no other part trains (flux-dev has its own); on the CPU the last
    one only: the smoke run checks the kit's code, which is the same for each (every family trains through
    stk-train in the test suite's ZeRO matrix)."""
    configs = [name for name in flow_configs() if name != "flux-dev"]
    return configs[-1:] if scale.cpu else configs


def part_families(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Each family's config at full width and --family-blocks blocks per block list, through stk-train at 1024 px:
    full with checkpointing and LoRA rank 16, each projected to the full model on 32 GPUs as flux is."""
    peak, _ = peak_tflops(args.peak_tflops)
    for name in family_configs(scale):
        depth = reduced_depth(name, scale.family_blocks)
        for variant in scale.family_variants:
            ours = train_stk(scale, work, name, scale.flux_batch, variant, [])
            row = {"config": name, "variant": variant, "blocks": depth, "batch": scale.flux_batch, **ours}
            if ours.get("oom"):
                yield result("families", **row)
                continue
            flops, projection = project(scale, work, name, variant, ours["step_s"], args)
            yield result(
                "families", **row, mfu=mfu(flops, ours["step_s"], peak), flops_per_step=flops, projection=projection
            )


def project(
    scale: Scale, work: Path, name: str, variant: str, step_s: float, args: argparse.Namespace
) -> tuple[int, dict[str, Any]]:
    """The measured step's FLOPs, and the full published model on 32 GPUs at batch 8: the FLOP rate this GPU reached
    over the full model's FLOPs on the same shapes (only depth differs), plus the communication a step waits on under
    the zero2 preset (bench/projection.zero_comm: what trains, the model or its LoRA, at --bus-gbps)."""
    peak, _ = peak_tflops(args.peak_tflops)
    model_dir, cache = model(scale, work, name), cached(scale, work, name)
    flops = step_flops(model_dir, cache, scale.flux_batch)
    rate = flops / step_s  # FLOP/s this GPU reached
    full = step_flops(model_dir, cache, scale.flux_batch, full_depth(name)) * (FLUX_BATCH / scale.flux_batch)
    zero2 = load_deepspeed_config("zero2")["zero_optimization"]
    fabric = Fabric(bus_gbps=args.bus_gbps)
    comm = zero_comm(
        trainable_params(name, variant), FLUX_GPUS, zero2["reduce_bucket_size"], zero2["overlap_comm"], fabric
    )
    projected = full / rate + comm["exposed_s"]
    return flops, {
        "gpus": FLUX_GPUS,
        "batch_per_gpu": FLUX_BATCH,
        "compute_s": round(full / rate, 3),
        "comm_s": round(comm["exposed_s"], 3),
        "bus_gbps": args.bus_gbps,
        "s_per_step": round(projected, 3),
        "mfu": mfu(int(full), projected, peak),
    }


def trainable_params(name: str, variant: str) -> int:
    """The published denoiser's trainable parameters: all of them, or stk's LoRA rank 16 (counted on meta)."""
    from stk.models.published import PUBLISHED, build_published, published_config
    from stk.train.trainable.lora import LoraSettings, add_lora

    denoiser = build_published(published_config(name, "denoiser"))
    if variant.startswith("lora"):
        add_lora(denoiser, LoraSettings(rank=LORA_RANK), PUBLISHED[name], seed=0)
    return sum(p.numel() for p in denoiser.parameters() if p.requires_grad)


def part_quant(scale: Scale, work: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The flux part's transformer, LoRA rank 16 with checkpointing, on a quantised base (--base-precision, each of
    scale.quant_precisions) against bf16: samples/s and peak memory of each (target: fp8 >= 1.2x bf16's samples/s).
    Where the device lacks the precision (fp8: the CPU, or compute capability below 8.9), stk-train's one line is the
    row, and bf16 is not run for it."""
    row = {"variant": "lora-ckpt", "blocks": list(scale.flux_blocks), "batch": scale.flux_batch}
    bf16: dict[str, Any] | None = None
    for precision in scale.quant_precisions:
        ours = train_stk(scale, work, "flux-dev", scale.flux_batch, "lora-ckpt", ["--base-precision", precision], True)
        if "refused" in ours:
            yield result("quant", **row, precision=precision, available=False, line=ours["refused"], ok=None)
            continue
        if "failed" in ours:
            yield result("quant", **row, precision=precision, available=True, **ours, ok=False)
            continue
        bf16 = bf16 or train_stk(scale, work, "flux-dev", scale.flux_batch, "lora-ckpt", [])
        ratio = None
        if not ours.get("oom") and not bf16.get("oom"):
            ratio = round(ours["samples_per_s"] / bf16["samples_per_s"], 3)
        target = TARGETS.get(f"{precision}_ratio")
        yield result(
            "quant",
            **row,
            precision=precision,
            available=True,
            **ours,
            baseline_ratio=ratio,
            bf16=bf16,
            target=target,
            ok=None if ratio is None or target is None else ratio >= target,
        )


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
    yield result(
        "breaker",
        step_s=round(statistics.median(plain), 5),
        watched_step_s=round(statistics.median(watched), 5),
        overhead_pct=round(overhead, 3),
        watch_active=active,
        target_pct=TARGETS["breaker_pct"],
        ok=active and overhead < TARGETS["breaker_pct"],
    )


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
    ran = run(
        stk(
            "train",
            *data,
            "--model",
            model(scale, work, "sdxl"),
            "--output-dir",
            out,
            "--max-steps",
            2,
            "--batch-size",
            scale.oom_batch,
            "--no-gradient-checkpointing",
            "--checkpoint-every",
            0,
            "--resume",
            "none",
            "--prefetch",
            1,
            "--allow-oversubscription",
            "-q",
        ),
        scale,
        check=False,
        limit_bytes=limit,
    )
    lines = ran.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    clear = ran.code == 3 and "Traceback" not in ran.stderr and "out of" in last and "memory" in last
    yield result(
        "oom",
        exit_code=ran.code,
        expected_exit_code=3,
        seconds=round(ran.seconds, 1),
        line=last,
        traceback="Traceback" in ran.stderr,
        ok=clear and ran.seconds < TARGETS["oom_s"],
    )
