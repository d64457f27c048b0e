"""What bench/gpu.py's parts run on: the scale (a GPU's, or --cpu's tiny shapes), its processes, its inputs (images,
scans, models, caches), and the FLOPs and MFU of a training step."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from denoisers import denoiser_of, reduced_depth

KEYS = ("samples_per_s", "peak_memory", "mfu", "baseline_ratio")


# Dense bf16 tensor-core peaks in TFLOPS (no sparsity), from the vendors' data sheets; the first name that the device
# name contains wins, so the specific names come first. --peak-tflops overrides.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.2),
)
PYTHON = sys.executable
LORA_RANK = 16  # the kit's adapter runs


CAPTION_WORDS = ("a", "photo", "of", "the", "red", "cat", "on", "blue", "painting", "dog", "with", "man")


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
    flux_batch: int  # flux and families
    oom_batch: int
    sdxl: dict[str, Any] = field(default_factory=dict)  # overrides of the published configs
    vae: dict[str, Any] = field(default_factory=dict)
    family_blocks: int = 4  # families: blocks per block-count key (bench/denoisers.py)
    family_variants: tuple[str, ...] = ("full-ckpt", "lora-ckpt")
    quant_precisions: tuple[str, ...] = ("int8", "fp8")  # quant: the --base-precision runs against bf16

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


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


def train_args(scale: Scale, work: Path, name: str, out: Path, batch: int, variant: str, steps: int) -> list[Any]:
    """stk-train's arguments for the kit's runs: `name`'s model and cache, ZeRO-2, no checkpoints, the variant's
    adapter (LoRA rank LORA_RANK) and checkpointing."""
    flags: list[Any] = ["--lora-rank", LORA_RANK] if variant.startswith("lora") else []
    flags += [] if variant.endswith("ckpt") else ["--no-gradient-checkpointing"]
    return [
        "--cache",
        cached(scale, work, name),
        "--scan",
        scanned(scale, work),
        "--model",
        model(scale, work, name),
        "--output-dir",
        out,
        "--max-steps",
        steps,
        "--epochs",
        1000,
        "--batch-size",
        batch,
        "--deepspeed",
        "zero2",
        "--checkpoint-every",
        0,
        "--resume",
        "none",
        "--allow-oversubscription",
        "-q",
        *flags,
    ]


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
        run(
            stk(
                "scan",
                root,
                "--out",
                out,
                "--resolution",
                resolution or scale.resolution,
                "--alignment",
                64,
                "--batch-size",
                1,
                "--gpus",
                1,
                "--allow-oversubscription",
                "-q",
            ),
            scale,
        )
    return out


def model(scale: Scale, work: Path, name: str) -> str:
    """A pipeline with `name`'s published denoiser and VAE (changed as the scale says), random bf16 weights."""
    from stk.models.tiny import build_published_model

    out = work / f"model-{name}"
    if not (out / "model_index.json").exists():
        device = "cuda" if not scale.cpu else "cpu"  # a GPU draws billions of random weights in seconds
        build_published_model(name, str(out), device=device, denoiser=denoiser_overrides(scale, name), vae=scale.vae)
    return str(out)


def denoiser_overrides(scale: Scale, name: str) -> dict[str, Any]:
    """The published denoiser's changes: full width (--cpu: the family's tiny widths) at the depth the part asks."""
    if name == "sdxl":
        return scale.sdxl
    widths = tiny_widths(name) if scale.cpu else {}
    if name == "flux-dev":
        return {**widths, **dict(zip(denoiser_of(name).blocks, scale.flux_blocks, strict=True))}
    return {**widths, **reduced_depth(name, scale.family_blocks)}


def tiny_widths(name: str) -> dict[str, Any]:
    """The config of the family's own tiny denoiser (stk.models.tiny, what the tests train), as overrides."""
    import tempfile

    from stk.models.families import spec_for
    from stk.models.published import PUBLISHED
    from stk.models.tiny import tiny_builder

    spec = spec_for(PUBLISHED[name])
    with tempfile.TemporaryDirectory() as scratch:
        denoiser = tiny_builder(spec.name)(Path(scratch), None, None)[spec.denoiser.subfolder]
    return {key: value for key, value in denoiser.config.items() if not key.startswith("_")}


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
    from stk.models.interface import StepInputs

    return StepInputs(
        latents=norm.normalize(batch.mean).to(device, dtype),
        text={name: value.to(device, dtype) for name, value in batch.text.items()},
        original_size=batch.original_size.to(device),
        crop_top_left=batch.crop_top_left.to(device),
    )


def cached_batch(cache: Path, size: int) -> Any:
    """The first `size` samples of the cache's largest bucket: the shapes stk-train trains on."""
    from stk.train.data.loader import CacheData

    with CacheData(str(cache)) as data:
        keys = max(data.buckets().values(), key=len)
        if len(keys) < size:
            raise SystemExit(f"{cache}: {len(keys)} samples in its largest bucket, fewer than a batch of {size}")
        return data.load(keys[:size]), data.config.norm


def step_flops(model_dir: str, cache: Path, batch_size: int, denoiser_overrides: dict[str, Any] | None = None) -> int:
    """Forward + backward FLOPs of one training step of the denoiser on a cached batch, counted by
    torch.utils.flop_counter on the meta device (no memory, any size); without checkpointing's recompute."""
    from torch.fx.experimental import _config as fx_config
    from torch.utils.flop_counter import FlopCounterMode

    from stk.models import detect_family
    from stk.models.published import build_published
    from stk.train.objective.objectives import objective_for

    objective = objective_for(detect_family(model_dir), model_dir)
    config = {
        **objective.denoiser_config(),
        "_class_name": objective.denoiser_class.__name__,
        **(denoiser_overrides or {}),
    }
    denoiser = build_published(config, "meta").to(torch.bfloat16)
    batch, norm = cached_batch(cache, batch_size)
    inputs = step_inputs(batch, norm, "meta", torch.bfloat16)
    # a family that drops padded text tokens by mask (Z-Image) indexes with it: on meta, every token counts as real
    with FlopCounterMode(display=False) as counter, fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        objective.loss(denoiser, inputs, torch.Generator().manual_seed(0)).backward()
    return int(counter.get_total_flops())


def mfu(flops: int, seconds: float, peak: float | None) -> float | None:
    return round(flops / seconds / (peak * 1e12), 4) if peak and seconds > 0 else None
