"""Benchmark the memory stk-train's options buy: gradient checkpointing, LoRA, and the DeepSpeed ZeRO presets.

    python bench/memory.py [--resolution 256] [--steps 3] [--threads 2] [--table] [--quick]

Every model is built at full width from its published config with random bf16 weights (no download), on the CPU,
and every configuration runs in a fresh process of this script, which reports its RSS high-water mark (VmHWM):

  1. Activations of the SDXL UNet (2.57B parameters) at --resolution px, batch 1: a forward pass under no_grad (the
     baseline), then a training step (forward + backward) with gradient checkpointing off and on. Every parameter
     requires grad, so autograd keeps what full fine-tuning keeps, but each gradient is dropped as soon as it lands
     (a post-accumulate-grad hook), so the gradients never pile up: what is subtracted for them is the largest
     single gradient, the most that is ever held. Activations = training peak - baseline peak - that gradient.
     Target: checkpointing cuts activations >= 3x. The step time with and without is the price of fitting (no
     target). A second, exact count comes from autograd itself: the bytes of the tensors it saves for backward.
  2. Gradients + AdamW state of LoRA rank 16 (stk.train.lora.add_lora) against full fine-tuning: one real AdamW step
     on the full-width UNet with the adapter; full fine-tuning does not fit this machine's RAM (5 GB weights, 5 GB
     gradients, 10 GB state), so its real step runs on a reduced UNet (full width, one transformer layer per block)
     and the bytes per parameter it measures are scaled to the full UNet's exact parameter count. Target: <= 2%.
  3. --table: per-GPU memory of Flux.1-dev and the SDXL UNet at 1024 px, batch 8 per GPU, on 32 GPUs, for each
     preset in stk/train/presets, checkpointing off and on, full fine-tune and LoRA, bf16 under DeepSpeed. Model
     states from the ZeRO paper's accounting and the presets' bucket sizes; activations measured here on the CPU
     (Flux: one double and one single block at 512 px with 128 text tokens, a quarter of 1024 px's 4096 + 512
     tokens in both streams; SDXL: the whole UNet at --resolution) and scaled linearly in tokens to 1024 px.

The script always exits 0: it is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

GB = 1e9
TARGETS = {"activation_reduction": 3.0, "lora_vs_full": 0.02}
LORA_RANK = 16

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
SDXL_UNET: dict[str, Any] = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "center_input_sample": False, "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
    "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default", "sample_size": 128, "time_cond_proj_dim": None,
    "time_embedding_act_fn": None, "time_embedding_dim": None, "time_embedding_type": "positional",
    "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}  # fmt: skip
# the full AdamW step of part 2 on a UNet that fits in RAM: same widths, one transformer layer per attention block
REDUCED_SDXL_UNET = {**SDXL_UNET, "transformer_layers_per_block": [1, 1, 1]}
# black-forest-labs/FLUX.1-dev, transformer/config.json
FLUX_DEV: dict[str, Any] = {
    "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
    "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
    "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56],
}  # fmt: skip
SDXL_TEXT_TOKENS = 77
BLOCK_KINDS = {"FluxTransformerBlock": "double", "FluxSingleTransformerBlock": "single"}

# --table: the reference run
GPUS, BATCH, RESOLUTION = 32, 8, 1024
FLUX_TEXT_TOKENS = 512  # stk.models.flux.T5_MAX_LENGTH
GPU_BYTES, HEADROOM = 80e9, 0.10  # an H100's 80 GB, 10% kept for the CUDA context, NCCL and fragmentation
# Presets from the least overhead to the most: ZeRO-2 adds a reduce-scatter per bucket, ZeRO-3 gathers every weight
# twice a step (three with checkpointing's recompute), and offload runs the optimizer on the host's CPUs over PCIe.
PRESETS = ("zero1", "zero2", "zero3", "zero2-offload")


# ---------------------------------------------------------------------------------------------------------------
# The measuring process (--child SPEC): one configuration, one fresh process, one JSON line on stdout.


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class SavedBytes:
    """What autograd keeps for the backward pass, by block kind: each storage counted once, parameters left out
    (they are the weights, not activations). A block's kind is set by hooks on the blocks, and by the checkpoint
    function, so that the inputs a checkpointed block keeps count for that block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_kind: dict[str, int] = defaultdict(int)
        self.kind = "other"
        for module in model.modules():
            kind = BLOCK_KINDS.get(type(module).__name__)
            if kind:
                module.register_forward_pre_hook(lambda *_, k=kind: setattr(self, "kind", k))
                module.register_forward_hook(lambda *_: setattr(self, "kind", "other"))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.by_kind[self.kind] += storage.nbytes()
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.seen.clear()
        self.by_kind.clear()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield

    def checkpoint(self, module: torch.nn.Module, *args: Any) -> Any:
        """diffusers' own checkpoint call (non-reentrant), with the block's kind set while it keeps its inputs."""
        previous, self.kind = self.kind, BLOCK_KINDS.get(type(module).__name__, self.kind)
        try:
            return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)
        finally:
            self.kind = previous


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The model with random weights created directly in bf16 (a float32 build would peak at twice the bytes)."""
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        if spec["model"] == "flux":
            return FluxTransformer2DModel(**{**FLUX_DEV, "num_layers": spec["double"], "num_single_layers": spec["single"]})
        return UNet2DConditionModel(**(REDUCED_SDXL_UNET if spec["model"] == "sdxl-reduced" else SDXL_UNET))
    finally:
        torch.set_default_dtype(torch.float32)


def make_inputs(spec: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """Random conditioning shaped as stk.train.objectives feeds each family, and a target for the MSE loss."""
    g = torch.Generator().manual_seed(1)
    side, res = spec["resolution"] // 8, spec["resolution"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    if spec["model"] == "flux":
        half, text = side // 2, spec["text_tokens"]
        ids = torch.zeros(half, half, 3)
        ids[..., 1], ids[..., 2] = torch.arange(half)[:, None], torch.arange(half)[None, :]
        inputs = {
            "hidden_states": randn(1, half * half, FLUX_DEV["in_channels"]),
            "encoder_hidden_states": randn(1, text, FLUX_DEV["joint_attention_dim"]),
            "pooled_projections": randn(1, FLUX_DEV["pooled_projection_dim"]),
            "timestep": torch.full((1,), 0.5, dtype=torch.bfloat16),
            "guidance": torch.full((1,), 3.5, dtype=torch.bfloat16),
            "txt_ids": torch.zeros(text, 3, dtype=torch.bfloat16),
            "img_ids": ids.reshape(-1, 3).to(torch.bfloat16),
        }
        return inputs, randn(1, half * half, FLUX_DEV["in_channels"])
    inputs = {
        "sample": randn(1, 4, side, side),
        "timestep": torch.full((1,), 500),
        "encoder_hidden_states": randn(1, SDXL_TEXT_TOKENS, SDXL_UNET["cross_attention_dim"]),
        "added_cond_kwargs": {
            "text_embeds": randn(1, 1280),
            "time_ids": torch.tensor([[res, res, 0, 0, res, res]], dtype=torch.bfloat16),
        },
    }
    return inputs, randn(1, 4, side, side)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, run 1 + spec['steps'] steps (autograd's saved bytes counted in the first), report memory and times.

    Modes: forward (no_grad), train (every parameter trainable, each gradient dropped as it lands), lora (the adapter
    trainable, its gradients kept) and adamw (every parameter trainable, gradients kept); lora and adamw end with one
    AdamW step and report the bytes of the gradients and of the optimizer state."""
    torch.set_num_threads(spec["threads"])
    model = build_model(spec)
    layers = 0
    if spec["mode"] == "lora":
        from stk.models import Family
        from stk.train.lora import LoraSettings, add_lora

        family = Family.FLUX if spec["model"] == "flux" else Family.SDXL
        layers = add_lora(model, LoraSettings(rank=LORA_RANK), family, seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if spec["mode"] == "train":
        for p in trainable:
            p.register_post_accumulate_grad_hook(_drop_grad)
    saved = SavedBytes(model)
    if spec["checkpointing"]:
        model.enable_gradient_checkpointing(saved.checkpoint)  # type: ignore[operator]
    inputs, target = make_inputs(spec)
    gc.collect()
    model_rss = status_bytes("VmRSS")
    times = []
    for step in range(1 + spec["steps"]):
        started = time.perf_counter()
        if spec["mode"] == "forward":
            with torch.no_grad():
                model(**inputs)
        else:
            with saved.recording() if step == 0 else nullcontext():
                out = model(**inputs, return_dict=False)[0]
                F.mse_loss(out.float(), target.float()).backward()
            del out
        times.append(time.perf_counter() - started)
    result: dict[str, Any] = {
        "spec": spec,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "trainable_dtype": str(trainable[0].dtype) if trainable else None,
        "lora_layers": layers,
        "largest_grad_bytes": max((p.numel() * p.element_size() for p in trainable), default=0),
        "model_rss": model_rss,
        "peak_rss": status_bytes("VmHWM"),
        "saved": dict(saved.by_kind),
        "step_s": statistics.median(times[1:]) if spec["steps"] else times[0],
        "first_step_s": times[0],
    }
    if spec["mode"] in ("lora", "adamw"):
        result["grad_bytes"] = sum(p.grad.nbytes for p in trainable if p.grad is not None)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        optimizer.step()
        result["adamw_state_bytes"] = sum(
            t.nbytes for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        )
    return result


# ---------------------------------------------------------------------------------------------------------------
# The report


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """measure(spec) in a fresh process, so that its RSS high-water mark is its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    # A fixed mmap threshold: every tensor over 256 KiB gets its own mapping and goes back to the OS when freed, so
    # RSS follows the live tensors instead of what glibc's heap keeps (its threshold would otherwise grow to 32 MiB).
    env.update(OMP_NUM_THREADS=str(spec["threads"]), MALLOC_MMAP_THRESHOLD_="262144", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def activation_bytes(r: dict[str, Any]) -> float:
    """What the step added on top of the built model, less the gradients held (the largest one when they are
    dropped as they land, all of them for LoRA): saved activations plus the backward pass's working set."""
    held = r.get("grad_bytes", r["largest_grad_bytes"])
    return float(r["peak_rss"] - r["model_rss"] - held)


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def sdxl_spec(mode: str, checkpointing: bool, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"model": "sdxl", "mode": mode, "checkpointing": checkpointing, "resolution": args.resolution,
            "steps": args.steps, "threads": args.threads, **extra}  # fmt: skip


def part_activations(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Part 1: the SDXL UNet's activations with and without checkpointing, each in a fresh process."""
    runs = {
        "forward": run_child(sdxl_spec("forward", False, args)),
        "off": run_child(sdxl_spec("train", False, args)),
        "on": run_child(sdxl_spec("train", True, args)),
    }
    base, off, on = runs["forward"], runs["off"], runs["on"]
    side = args.resolution // 8
    print(f"\n## 1. Activations: SDXL UNet, {base['params']:,} parameters in bf16 (random), {args.resolution} px "
          f"({side}x{side} latents), batch 1, {args.threads} threads, one fresh process each")  # fmt: skip
    print(f"{'configuration':<34}{'peak RSS':>10}{'model RSS':>11}{'step adds':>11}{'autograd saved':>16}"
          f"{'step (median)':>15}{'process':>9}")  # fmt: skip
    for label, r in (("forward under no_grad (baseline)", base), ("train step, checkpointing off", off),
                     ("train step, checkpointing on", on)):  # fmt: skip
        saved = gb(sum(r["saved"].values())) if r["spec"]["mode"] != "forward" else "-"
        print(f"{label:<34}{gb(r['peak_rss']):>10}{gb(r['model_rss']):>11}{gb(r['peak_rss'] - r['model_rss']):>11}"
              f"{saved:>16}{r['step_s']:>13.2f} s{r['wall_s']:>7.0f} s")  # fmt: skip
    grad = off["largest_grad_bytes"]
    act_off = off["peak_rss"] - base["peak_rss"] - grad
    act_on = on["peak_rss"] - base["peak_rss"] - grad
    ratio = act_off / act_on if act_on > 0 else float("inf")
    print(f"activations = train peak - baseline peak - largest gradient ({grad / 1e6:.0f} MB; each gradient is dropped "
          f"as it lands): off {gb(act_off)}, on {gb(act_on)}: reduced {ratio:.1f}x (target >= "
          f"{TARGETS['activation_reduction']:.0f}x): {verdict(ratio >= TARGETS['activation_reduction'])}")  # fmt: skip
    strict_off, strict_on = activation_bytes(off), activation_bytes(on)
    print(f"the same over the built model's RSS instead of the baseline's peak (keeps the forward's transients): "
          f"off {gb(strict_off)}, on {gb(strict_on)}: {strict_off / strict_on:.1f}x")  # fmt: skip
    saved_off, saved_on = sum(off["saved"].values()), sum(on["saved"].values())
    print(f"autograd's saved tensors alone (exact, no working set): off {gb(saved_off)}, on {gb(saved_on)}: "
          f"{saved_off / saved_on:.1f}x")  # fmt: skip
    cost = on["step_s"] / off["step_s"]
    print(f"step time (forward + backward, median of {args.steps} after a warm-up): off {off['step_s']:.2f} s, "
          f"on {on['step_s']:.2f} s: checkpointing costs {cost:.2f}x ({(cost - 1) * 100:+.0f}%; no target)")  # fmt: skip
    return runs


def part_lora(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Part 2: gradients + AdamW state, LoRA rank 16 against full fine-tuning."""
    lora = run_child(sdxl_spec("lora", False, args))
    reduced = run_child({**sdxl_spec("adamw", False, args), "model": "sdxl-reduced", "steps": 0})
    full_params = lora["params"] - lora["trainable"]
    lora_bytes = lora["grad_bytes"] + lora["adamw_state_bytes"]
    per_param = (reduced["grad_bytes"] + reduced["adamw_state_bytes"]) / reduced["trainable"]
    full_bytes = per_param * full_params
    share = lora["trainable"] / full_params
    print(f"\n## 2. Gradients + AdamW state: LoRA rank {LORA_RANK} against full fine-tuning, SDXL UNet")
    print(f"LoRA (stk.train.lora.add_lora): {lora['lora_layers']} layers adapted, {lora['trainable']:,} trainable "
          f"parameters ({lora['trainable_dtype']}) = {share * 100:.3f}% of the UNet's {full_params:,}")  # fmt: skip
    print(f"one real AdamW step, full-width UNet with the adapter: gradients {lora['grad_bytes'] / 1e6:.1f} MB + "
          f"AdamW state {lora['adamw_state_bytes'] / 1e6:.1f} MB = {lora_bytes / 1e6:.1f} MB "
          f"({lora_bytes / lora['trainable']:.2f} B per trainable parameter)")  # fmt: skip
    print(f"full fine-tune: its step does not fit {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} "
          f"GiB of RAM, so one real AdamW step ran on a reduced UNet (full width, transformer_layers_per_block "
          f"[1, 1, 1]: {reduced['trainable']:,} parameters, {reduced['trainable_dtype']}): gradients "
          f"{gb(reduced['grad_bytes'])} + state {gb(reduced['adamw_state_bytes'])} = {per_param:.2f} B per parameter; "
          f"x {full_params:,} parameters = {gb(full_bytes)} (computed, not measured)")  # fmt: skip
    ratio = lora_bytes / full_bytes
    print(f"LoRA / full: {ratio * 100:.3f}% (target <= {TARGETS['lora_vs_full'] * 100:.0f}%): "
          f"{verdict(ratio <= TARGETS['lora_vs_full'])}")  # fmt: skip
    ds = 2 + 4 + 4 + 4  # DeepSpeed bf16: bf16 gradient, fp32 master weight, fp32 Adam m and v
    print(f"under DeepSpeed bf16 ({ds} B per trainable parameter: bf16 gradient, fp32 master, m and v): LoRA "
          f"{gb(ds * lora['trainable'])}, full {gb(ds * full_params)}: {share * 100:.3f}%, the same ratio")  # fmt: skip
    return {"lora": lora, "reduced": reduced}


# ---------------------------------------------------------------------------------------------------------------
# Part 3: the table


@dataclass(frozen=True)
class Model:
    """A denoiser's parameter counts (from its config on the meta device) and its per-sample activations at 1024 px."""

    name: str
    params: int
    lora: int  # the rank-16 adapter's parameters
    largest: int  # the largest parameter's elements (ZeRO-3 gathers a module at a time)
    small: int  # elements of the parameters ZeRO-3 keeps whole on every GPU (at most its persistence threshold)
    activations: dict[tuple[str, bool], float]  # (full | lora, checkpointing) -> bytes per sample at 1024 px


def counts(name: str, config: dict[str, Any], threshold: int) -> tuple[int, int, int, int]:
    """Parameters, LoRA rank-16 parameters, the largest parameter and the ZeRO-3-persistent ones, on meta."""
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    from stk.models import Family
    from stk.train.lora import LoraSettings, add_lora

    cls, family = (FluxTransformer2DModel, Family.FLUX) if name == "flux" else (UNet2DConditionModel, Family.SDXL)
    with torch.device("meta"):
        model = cls(**config)
    sizes = [p.numel() for p in model.parameters()]
    add_lora(model, LoraSettings(rank=LORA_RANK), family, seed=0)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return sum(sizes), lora, max(sizes), sum(n for n in sizes if n < threshold)


def flux_activations(args: argparse.Namespace) -> tuple[dict[tuple[str, bool], float], list[str]]:
    """Per-sample activation bytes of the full Flux at 1024 px, from one double and one single block measured at
    a quarter of its tokens: autograd's saved bytes per block kind (exact) times the blocks' count, plus what is
    saved outside the blocks, plus the backward working set (the peak RSS over the model, less the saved bytes and
    the gradients held), all scaled by the token ratio."""
    res, text = (256, 32) if args.quick else (512, 128)
    tokens = (res // 16) ** 2 + text
    scale = ((RESOLUTION // 16) ** 2 + FLUX_TEXT_TOKENS) / tokens
    spec = {"model": "flux", "resolution": res, "text_tokens": text, "double": 1, "single": 1, "steps": 0,
            "threads": args.threads}  # fmt: skip
    out: dict[tuple[str, bool], float] = {}
    lines = [f"Flux activations: 1 double + 1 single block at full width, {res} px ({(res // 16) ** 2} image + {text} "
             f"text tokens), scaled x{scale:.1f} to {RESOLUTION} px ({(RESOLUTION // 16) ** 2} + {FLUX_TEXT_TOKENS})"]  # fmt: skip
    for mode, ckpt in (("train", False), ("train", True), ("lora", False), ("lora", True)):
        r = run_child({**spec, "mode": mode, "checkpointing": ckpt})
        s = r["saved"]
        working = activation_bytes(r) - sum(s.values())
        total = s.get("other", 0) + FLUX_DEV["num_layers"] * s["double"] + FLUX_DEV["num_single_layers"] * s["single"]
        key = ("full" if mode == "train" else "lora", ckpt)
        if key == ("full", False):
            saved_off = s
        out[key] = (total + working) * scale
        lines.append(f"  {key[0]:<4} checkpointing {'on ' if ckpt else 'off'}: saved per double block "
                     f"{s['double'] / 1e6:.1f} MB, per single block {s['single'] / 1e6:.1f} MB, outside the blocks "
                     f"{s.get('other', 0) / 1e6:.1f} MB, working set {working / 1e6:.0f} MB (peak RSS "
                     f"{gb(r['peak_rss'])}, {r['wall_s']:.0f} s) -> {gb(out[key])} per sample at {RESOLUTION} px")  # fmt: skip
    if not args.quick:  # the linearity the scaling assumes: the same blocks again at a quarter of the tokens
        small_tokens = (256 // 16) ** 2 + 32
        r = run_child({**spec, "mode": "train", "checkpointing": False, "resolution": 256, "text_tokens": 32})
        for kind in ("double", "single"):
            ratio = saved_off[kind] / r["saved"][kind]
            lines.append(f"  linearity: a {kind} block saves {r['saved'][kind] / 1e6:.1f} MB at {small_tokens} tokens, "
                         f"{saved_off[kind] / 1e6:.1f} MB at {tokens}: x{ratio:.2f} for x{tokens / small_tokens:.1f} "
                         "tokens")  # fmt: skip
    return out, lines


def zero_states(m: Model, lora: bool, preset: str, ds: dict[str, Any]) -> dict[str, float]:
    """Per-GPU bytes of the model states under bf16 DeepSpeed (ZeRO paper, section 5: bf16 weights and gradients,
    fp32 master weights, Adam m and v) and the preset's communication buffers (DeepSpeed 0.19 allocates
    reduce_bucket_size elements once, twice with overlap_comm)."""
    zero = ds["zero_optimization"]
    stage, offload = zero["stage"], zero.get("offload_optimizer", {}).get("device", "none") != "none"
    params = m.params + (m.lora if lora else 0)
    trainable = m.lora if lora else m.params
    if stage == 3:  # partitioned, plus the small parameters kept whole and the gathered ones in flight
        weights = 2 * (params / GPUS + m.small + m.largest + zero["stage3_prefetch_bucket_size"])
    else:
        weights = 2 * params
    grads = 0 if offload else 2 * trainable / (GPUS if stage >= 2 else 1)
    optimizer = 0 if offload else 12 * trainable / GPUS
    buffers = 2 * zero["reduce_bucket_size"] * (2 if zero.get("overlap_comm") and stage < 3 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "buffers": buffers}


def part_table(args: argparse.Namespace, sdxl_runs: dict[str, dict[str, Any]]) -> None:
    """Part 3: the memory table of the reference run."""
    from stk.train.dsconfig import load_deepspeed_config

    presets = {name: load_deepspeed_config(name) for name in PRESETS}
    threshold = presets["zero3"]["zero_optimization"]["stage3_param_persistence_threshold"]
    flux_act, flux_lines = flux_activations(args)
    lora_on = run_child(sdxl_spec("lora", True, args))
    scale = (RESOLUTION / args.resolution) ** 2
    sdxl_act = {
        ("full", False): activation_bytes(sdxl_runs["off"]) * scale,
        ("full", True): activation_bytes(sdxl_runs["on"]) * scale,
        ("lora", False): activation_bytes(sdxl_runs["lora"]) * scale,
        ("lora", True): activation_bytes(lora_on) * scale,
    }
    models = [Model("Flux.1-dev", *counts("flux", FLUX_DEV, threshold), flux_act),
              Model("SDXL UNet", *counts("sdxl", SDXL_UNET, threshold), sdxl_act)]  # fmt: skip
    budget = GPU_BYTES * (1 - HEADROOM)
    print(f"\n## 3. Per-GPU memory at {RESOLUTION} px, batch {BATCH} per GPU, {GPUS} GPUs, bf16 DeepSpeed")
    for line in flux_lines:
        print(line)
    print(f"SDXL activations: the whole UNet at {args.resolution} px (part 1 and the LoRA runs, peak RSS over the "
          f"model less the gradients held), scaled x{scale:.0f} in latent pixels to {RESOLUTION} px")  # fmt: skip
    for m in models:
        print(f"{m.name}: {m.params:,} parameters, LoRA rank {LORA_RANK} {m.lora:,} ({m.lora / m.params * 100:.2f}%); "
              f"activations per sample at {RESOLUTION} px: " + ", ".join(
                  f"{mode} ckpt {'on' if ck else 'off'} {gb(v)}" for (mode, ck), v in m.activations.items()))  # fmt: skip
    print(f"fits: total <= {budget / GB:.0f} GB ({GPU_BYTES / GB:.0f} GB less {HEADROOM * 100:.0f}% headroom for the "
          "CUDA context, NCCL and fragmentation). GB = 10^9 bytes.\n")  # fmt: skip
    print("| model | mode | checkpointing | preset | weights | grads | optimizer | buffers | activations | total | fits |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    best: dict[tuple[str, str, bool], str] = {}
    for m in models:
        for mode in ("full", "lora"):
            for ckpt in (False, True):
                for preset in PRESETS:
                    s = zero_states(m, mode == "lora", preset, presets[preset])
                    act = m.activations[(mode, ckpt)] * BATCH
                    total = sum(s.values()) + act
                    fits = total <= budget
                    if fits:
                        best.setdefault((m.name, mode, ckpt), preset)
                    cells = [s["weights"], s["grads"], s["optimizer"], s["buffers"], act, total]
                    print(f"| {m.name} | {mode} | {'on' if ckpt else 'off'} | {preset} | "
                          + " | ".join(f"{c / GB:.1f}" for c in cells) + f" | {'yes' if fits else 'no'} |")  # fmt: skip
    print("\nThe lowest-overhead preset that fits (order: " + ", ".join(PRESETS) + "):")
    for m in models:
        for mode in ("full", "lora"):
            choice = [f"checkpointing {'on' if ck else 'off'}: {best.get((m.name, mode, ck), 'none fits')}"
                      for ck in (False, True)]  # fmt: skip
            print(f"  {m.name}, {mode}: " + "; ".join(choice))
    host = 16 * models[0].params / GPUS
    print(f"zero2-offload's host memory (fp32 master, m, v and gradient, 16 B per trainable parameter / {GPUS}): "
          f"{models[0].name} full {gb(host)} per GPU, {gb(8 * host)} per 8-GPU node")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", type=int, default=256, help="SDXL's measured resolution in px (multiple of 32)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (OMP_NUM_THREADS) per process")
    parser.add_argument("--table", action="store_true", help="also the per-GPU memory table of the reference run")
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 px, one timed step, Flux at 256 px")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return
    if args.quick:
        args.resolution, args.steps = 128, 1
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    print(f"# bench/memory.py on {platform.node()}: {os.cpu_count()} cores, {ram:.0f} GiB RAM, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    runs = part_activations(args)
    runs.update(part_lora(args))
    if args.table:
        part_table(args, runs)


if __name__ == "__main__":
    main()
