"""Part 3 of bench/memory.py (--table): per-GPU memory of each flow family's published denoiser (Flux.1-dev first, then
every other config bench/denoisers.py knows) and the SDXL UNet at 1024 px on 32 GPUs for each preset, from the ZeRO
paper's accounting of model states and activations extrapolated from measured sizes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from denoisers import TITLES, denoiser_of, flow_configs, full_depth
from memory_common import GB, LORA_RANK, SDXL_UNET, Runs, activation_bytes, gb, run_child, sdxl_spec

from stk.models.published import PUBLISHED, build_published, published_config

# --table: the reference run
GPUS, BATCH, RESOLUTION = 32, 8, 1024
GPU_BYTES, HEADROOM = 80e9, 0.10  # an H100's 80 GB, 10% kept for the CUDA context, NCCL and fragmentation
# Presets from the least overhead to the most: ZeRO-2 adds a reduce-scatter per bucket, ZeRO-3 gathers every weight
# twice a step (three with checkpointing's recompute), and offload runs the optimizer on the host's CPUs over PCIe.
PRESETS = ("zero1", "zero2", "zero3", "zero2-offload")


@dataclass(frozen=True)
class Activations:
    """One configuration's activation bytes on a GPU at the reference run's size, from the CPU measurements."""

    saved: float  # per sample: autograd's saved tensors at full depth (checkpointing: the blocks' kept inputs)
    recompute: float  # per sample: the largest block's saved tensors, held again while checkpointing recomputes it
    working: float  # per sample: 3 x the largest saved tensor, the gradients in flight in the backward (assumed)
    fixed: float  # per step: what the CPU step held beyond these and does not grow with the image

    def at(self, batch: int) -> float:
        return batch * (self.saved + self.recompute + self.working) + self.fixed

    def largest_batch(self, room: float) -> int:
        """The most samples whose activations fit in `room` bytes (0: not one)."""
        return max(0, int((room - self.fixed) // (self.saved + self.recompute + self.working)))


@dataclass(frozen=True)
class Model:
    """A denoiser's parameter counts (from its config on the meta device) and its activations."""

    name: str
    params: int
    lora: int  # the rank-16 adapter's parameters
    largest: int  # the largest parameter's elements (ZeRO-3 gathers a module at a time)
    small: int  # elements of the parameters ZeRO-3 keeps whole on every GPU (under its persistence threshold)
    small_lora: int  # the same among the adapter's parameters
    activations: dict[tuple[str, bool], Activations]  # (full | lora, checkpointing)


def counts(name: str, config: dict[str, Any], threshold: int) -> tuple[int, int, int, int, int]:
    """Parameters, LoRA rank-16 parameters, the largest parameter and the ZeRO-3-persistent ones (of the model, of
    the adapter), counted on the meta device."""
    from stk.train.trainable.lora import LoraSettings, add_lora

    model = build_published(config)
    sizes = [p.numel() for p in model.parameters()]
    add_lora(model, LoraSettings(rank=LORA_RANK), PUBLISHED[name], seed=0)
    adapter = [p.numel() for p in model.parameters() if p.requires_grad]
    small = sum(n for n in sizes if n < threshold)
    return sum(sizes), sum(adapter), max(sizes), small, sum(n for n in adapter if n < threshold)


def extrapolate(points: list[tuple[float, float]], x: float) -> float:
    """The line through two measurements, at x (activations grow linearly in tokens with a flash/efficient SDPA)."""
    (x1, y1), (x2, y2) = points
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def estimate(runs: Runs, mode: str, ckpt: bool, sizes: dict[int, float], target: float, depth: Any) -> Activations:
    """Activations at `target` (latent pixels or tokens) from runs at two `sizes` (resolution -> pixels or tokens);
    depth(saved by kind) gives the full model's saved bytes from the measured one's."""

    def line(value: Any, ck: bool) -> float:
        return extrapolate([(x, float(value(runs[(mode, ck, res)]))) for res, x in sizes.items()], target)

    def rest(res: int) -> float:
        r = runs[(mode, ckpt, res)]
        recompute = runs[(mode, False, res)]["largest_block"] if ckpt else 0
        return activation_bytes(r) - sum(r["saved"].values()) - recompute

    return Activations(
        saved=line(lambda r: depth(r["saved"]), ckpt),
        recompute=line(lambda r: r["largest_block"], False) if ckpt else 0.0,
        working=3 * line(lambda r: r["largest_tensor"], False),
        fixed=max(0.0, *(rest(res) for res in sizes)),
    )


@dataclass(frozen=True)
class Measured:
    """A transformer's runs at full width with its measured blocks, at two sizes, and what they say."""

    config: str
    runs: Runs
    tokens: dict[int, float]  # resolution -> image + text tokens
    lines: list[str]  # the linearity of each block kind's saved bytes

    @property
    def target(self) -> int:
        return (RESOLUTION // 16) ** 2 + denoiser_of(self.config).text_tokens

    def depth(self, saved: dict[str, int]) -> float:
        """The full model's saved bytes from the measured one's: each scaled block list at its published count."""
        d = denoiser_of(self.config)
        scale = {d.blocks[key]: n / d.measured_blocks for key, n in full_depth(self.config).items()}
        return sum(size * scale.get(kind, 1) for kind, size in saved.items())


def transformer_runs(config: str, args: argparse.Namespace) -> Measured:
    """The config's measured blocks at full width (bench/denoisers.py), at two sizes with 1024 px's ratio of image
    to text tokens (FLUX.1: 256 and 512 px, 32 and 128 text tokens)."""
    text = denoiser_of(config).text_tokens
    sizes = (256, 128) if args.quick else (512, 256)
    texts = {res: max(1, round(text * (res / RESOLUTION) ** 2)) for res in sizes}
    runs: Runs = {}
    for res in sizes:
        for mode in ("train", "lora"):
            for ckpt in (False, True):
                runs[(mode, ckpt, res)] = run_child(
                    {
                        "model": config,
                        "mode": mode,
                        "checkpointing": ckpt,
                        "resolution": res,
                        "text_tokens": texts[res],
                        "threads": args.threads,
                    }
                )
    tokens = {res: (res // 16) ** 2 + texts[res] for res in sizes}
    big, small = sizes
    lines = []
    for kind in denoiser_of(config).blocks.values():
        a, b = runs[("train", False, small)]["saved"][kind], runs[("train", False, big)]["saved"][kind]
        lines.append(
            f"  {TITLES[config]}: {kind} saves {a / 1e6:.1f} MB at {tokens[small]} tokens, {b / 1e6:.1f} MB "
            f"at {tokens[big]}: x{b / a:.2f} for x{tokens[big] / tokens[small]:.2f} tokens"
        )
    return Measured(config, runs, {res: float(x) for res, x in tokens.items()}, lines)


CONFIGS = [(mode, ckpt) for mode in ("full", "lora") for ckpt in (False, True)]


def transformer_model(m: Measured, threshold: int) -> Model:
    return Model(
        TITLES[m.config],
        *counts(m.config, published_config(m.config, "denoiser"), threshold),
        {
            (mode, ckpt): estimate(m.runs, "train" if mode == "full" else "lora", ckpt, m.tokens, m.target, m.depth)
            for mode, ckpt in CONFIGS
        },
    )


def zero_states(m: Model, lora: bool, ds: dict[str, Any]) -> dict[str, float]:
    """Per-GPU bytes of the model states under bf16 DeepSpeed (ZeRO paper, section 5: bf16 weights and gradients,
    fp32 master weights, Adam m and v; offload moves the fp32 states and gradients to the host) and the preset's
    gradient buckets (DeepSpeed 0.19 allocates reduce_bucket_size elements once, twice with overlap_comm below
    stage 3, whatever the number of trainable parameters)."""
    zero = ds["zero_optimization"]
    stage, offload = zero["stage"], zero.get("offload_optimizer", {}).get("device", "none") != "none"
    params = m.params + (m.lora if lora else 0)
    trainable = m.lora if lora else m.params
    if stage == 3:  # partitioned, plus the small parameters kept whole and the gathered ones in flight
        small = m.small + (m.small_lora if lora else 0)
        weights = 2 * (params / GPUS + small + m.largest + zero["stage3_prefetch_bucket_size"])
    else:
        weights = 2 * params
    grads = 0 if offload else 2 * trainable / (GPUS if stage >= 2 else 1)
    optimizer = 0 if offload else 12 * trainable / GPUS
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "buffers": bucket_bytes(zero)}


def bucket_bytes(zero: dict[str, Any]) -> float:
    """The gradient buckets DeepSpeed 0.19 allocates under a zero_optimization section, bf16: reduce_bucket_size
    elements once, twice with overlap_comm below stage 3 (its stage_1_and_2 optimizer)."""
    overlapped = zero.get("overlap_comm") and zero["stage"] < 3
    return 2 * zero["reduce_bucket_size"] * (2 if overlapped else 1)


def sdpa_backward() -> str:
    """Which SDPA kernel autograd records on this machine: a flash kernel saves q, k, v, the output and logsumexp
    (memory linear in tokens); the math fallback would save the attention matrix (quadratic)."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    return type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__


def part_table(args: argparse.Namespace, sdxl: Runs) -> None:
    """Part 3: the memory table of the reference run."""
    from stk.train.deepspeed.config import load_deepspeed_config

    presets = {name: load_deepspeed_config(name) for name in PRESETS}
    threshold = presets["zero3"]["zero_optimization"]["stage3_param_persistence_threshold"]
    res, half = args.resolution, args.resolution // 2
    for size, ckpt in ((res, True), (half, False), (half, True)):
        sdxl[("lora", ckpt, size)] = run_child(sdxl_spec("lora", ckpt, size, args))
    configs = args.configs.split(",") if args.configs else flow_configs()
    measured = [transformer_runs(config, args) for config in configs]
    sdxl_pixels = {size: float((size // 8) ** 2) for size in (res, half)}
    models = [transformer_model(m, threshold) for m in measured] + [
        Model(
            "SDXL UNet",
            *counts("sdxl", SDXL_UNET, threshold),
            {
                (mode, ckpt): estimate(
                    sdxl,
                    "train" if mode == "full" else "lora",
                    ckpt,
                    sdxl_pixels,
                    (RESOLUTION // 8) ** 2,
                    lambda s: sum(s.values()),
                )
                for mode, ckpt in CONFIGS
            },
        ),
    ]
    print(f"\n## 3. Per-GPU memory at {RESOLUTION} px, batch {BATCH} per GPU, {GPUS} GPUs, bf16 DeepSpeed")
    for m in measured:
        blocks = ", ".join(f"{n} {denoiser_of(m.config).blocks[key]}" for key, n in full_depth(m.config).items())
        print(
            f"{TITLES[m.config]}: {denoiser_of(m.config).measured_blocks} block(s) of each list at full width, "
            f"measured at {sorted(m.tokens.values())} tokens (image + text, as at {RESOLUTION} px), extrapolated "
            f"to {(RESOLUTION // 16) ** 2} + {denoiser_of(m.config).text_tokens} tokens and to {blocks}"
        )
    print("linearity:")
    for m in measured:
        for line in m.lines:
            print(line)
    saved = {size: gb(sum(sdxl[("train", False, size)]["saved"].values())) for size in (half, res)}
    print(
        f"SDXL: the whole UNet at {half} and {res} px, extrapolated in latent pixels to {RESOLUTION // 8}x"
        f"{RESOLUTION // 8}; saved at {half} px {saved[half]}, at {res} px {saved[res]} (x4 pixels, the "
        f"{denoiser_of('sdxl').text_tokens} text tokens fixed)"
    )
    print(
        f"attention: the CPU's SDPA records {sdpa_backward()} (saves q, k, v, output, logsumexp: linear in tokens, "
        "as flash/memory-efficient SDPA on a GPU)"
    )
    print("activations per GPU = batch x (saved + recompute + working) + fixed; per sample at 1024 px:")
    for m in models:
        for (mode, ckpt), a in m.activations.items():
            print(
                f"  {m.name:<13}{mode:<5}ckpt {'on ' if ckpt else 'off'}: saved {gb(a.saved)}, recompute "
                f"{gb(a.recompute)}, working {gb(a.working)}; fixed {gb(a.fixed)} per step -> {gb(a.at(BATCH))} "
                f"at batch {BATCH}"
            )
    print(f"parameters (LoRA rank {LORA_RANK}): " + "; ".join(f"{m.name} {m.params:,} ({m.lora:,})" for m in models))
    print_table(models, presets)


def print_table(models: list[Model], presets: dict[str, Any]) -> None:
    """The table, the lowest-overhead preset that fits each model and mode, and offload's host memory."""
    budget = GPU_BYTES * (1 - HEADROOM)
    print(
        f"fits: total <= {budget / GB:.0f} GB ({GPU_BYTES / GB:.0f} GB less {HEADROOM * 100:.0f}% for the CUDA "
        "context, NCCL and fragmentation). GB = 10^9 bytes.\n"
    )
    print(
        "| model | mode | ckpt | preset | weights | grads | optimizer | buffers | activations | total | fits | "
        "largest batch |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    best: dict[tuple[str, str, bool], str] = {}
    for m in models:
        for mode, ckpt in CONFIGS:
            for preset in PRESETS:
                states = zero_states(m, mode == "lora", presets[preset])
                act = m.activations[(mode, ckpt)].at(BATCH)
                total = sum(states.values()) + act
                if total <= budget:
                    best.setdefault((m.name, mode, ckpt), preset)
                cells = " | ".join(f"{c / GB:.1f}" for c in [*states.values(), act, total])
                fits = "yes" if total <= budget else "no"
                largest = m.activations[(mode, ckpt)].largest_batch(budget - sum(states.values()))
                print(f"| {m.name} | {mode} | {'on' if ckpt else 'off'} | {preset} | {cells} | {fits} | {largest} |")
    print("\nthe lowest-overhead preset that fits (in order: " + ", ".join(PRESETS) + "):")
    for m in models:
        for mode in ("full", "lora"):
            print(
                f"  {m.name}, {mode}: "
                + "; ".join(
                    f"checkpointing {'on' if ck else 'off'}: {best.get((m.name, mode, ck), 'none fits')}"
                    for ck in (False, True)
                )
            )
    for m in models:
        host = 16 * m.params / GPUS
        print(
            f"zero2-offload's host memory for {m.name} full (fp32 master, m, v and gradient, 16 B per trainable "
            f"parameter / {GPUS}): {gb(host)} per GPU, {gb(8 * host)} per 8-GPU node"
        )
