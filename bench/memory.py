"""Benchmark the memory stk-train's options buy: gradient checkpointing, LoRA, and the DeepSpeed ZeRO presets.

    python bench/memory.py [--resolution 256] [--steps 3] [--threads 2] [--table] [--quick]

Every model is built at full width from its published config with random bf16 weights (no download), on the CPU,
and every configuration runs in a fresh process of this script, which reports its RSS high-water mark (VmHWM):

  1. Activations of the SDXL UNet (2.57B parameters), batch 1: a forward pass under no_grad at --resolution (the
     baseline), and a training step (forward + backward) with gradient checkpointing off and on, at --resolution
     and at half of it. Every parameter requires grad, so autograd keeps
     what full fine-tuning keeps, but each gradient is dropped as it lands (a post-accumulate-grad hook): the
     gradient memory at the peak is one weight's gradient in flight, measured on its own (the backward of the
     largest layer alone). Activations, three ways: (a) training peak - baseline peak - that gradient; (b) what
     grows with the image between the two resolutions; (c) autograd's own count of the tensors it saves (exact).
     Target: checkpointing cuts activations >= 3x. The step time with and without is the price of fitting: one
     more process alternates the two, --steps rounds after a warm-up round, so that load from elsewhere hits both.
  2. Gradients + AdamW state of LoRA rank 16 (stk.train.lora.add_lora) against full fine-tuning: one real AdamW step
     on the full-width UNet with the adapter; full fine-tuning does not fit this machine's RAM (5 GB weights, 5 GB
     gradients, 10 GB state), so its real step runs on a reduced UNet (full width, one transformer layer per block)
     and the bytes per parameter it measures are scaled to the full UNet's exact parameter count. Target: <= 2%.
  3. --table: per-GPU memory of Flux.1-dev and the SDXL UNet at 1024 px, batch 8 per GPU, on 32 GPUs, for each
     preset in stk/train/presets, checkpointing off and on, full fine-tune and LoRA, bf16 under DeepSpeed. Model
     states: the ZeRO paper's accounting and the presets' bucket sizes. Activations: autograd's count at two sizes
     (Flux: one double and one single block at 256 and 512 px, with 32 and 128 text tokens, 1024 px's 8:1 ratio;
     SDXL: the whole UNet at --resolution and half), extrapolated linearly in tokens (PyTorch's SDPA keeps attention
     linear, on this CPU as with flash attention on a GPU) and scaled to the full depth; plus, with checkpointing,
     the largest block's saved tensors while it is recomputed; plus 3x the largest saved tensor for the gradients
     in flight (an assumption); plus what the CPU step held beyond all that (not scaled: it does not grow).

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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stk.models.published import build_published, published_config

GB = 1e9
TARGETS = {"activation_reduction": 3.0, "lora_vs_full": 0.02}
LORA_RANK = 16

SDXL_UNET = published_config("sdxl", "denoiser")
# the full AdamW step of part 2 on a UNet that fits in RAM: same widths, one transformer layer per attention block
REDUCED_SDXL_UNET = {**SDXL_UNET, "transformer_layers_per_block": [1, 1, 1]}
FLUX_DEV = published_config("flux-dev", "denoiser")
SDXL_TEXT_TOKENS = 77
# the modules diffusers' enable_gradient_checkpointing checkpoints one by one, and what this script calls them
BLOCK_KINDS = {"ResnetBlock2D": "resnet", "BasicTransformerBlock": "transformer",
               "FluxTransformerBlock": "double", "FluxSingleTransformerBlock": "single"}  # fmt: skip

# --table: the reference run
GPUS, BATCH, RESOLUTION = 32, 8, 1024
FLUX_TEXT_TOKENS = 512  # stk.models.families.flux.T5_MAX_LENGTH
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
    """What autograd keeps for the backward pass: each storage counted once, parameters left out (they are the
    weights, not activations), by the kind of block that saved it, with the largest block instance and the largest
    single storage. Blocks are the modules diffusers checkpoints; forward hooks on them (and the checkpoint function,
    so that a checkpointed block's kept inputs count for it) say which one is running."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_kind: dict[str, int] = defaultdict(int)
        self.by_block: dict[int, int] = defaultdict(int)
        self.largest = 0
        self.block: tuple[str, int] = ("other", 0)
        for module in model.modules():
            if type(module).__name__ in BLOCK_KINDS:
                module.register_forward_pre_hook(lambda m, _: setattr(self, "block", self._block_of(m)))
                module.register_forward_hook(lambda *_: setattr(self, "block", ("other", 0)))

    @staticmethod
    def _block_of(module: torch.nn.Module) -> tuple[str, int]:
        return BLOCK_KINDS[type(module).__name__], id(module)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            kind, block = self.block
            self.by_kind[kind] += size
            if block:
                self.by_block[block] += size
            self.largest = max(self.largest, size)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield

    def checkpoint(self, module: torch.nn.Module, *args: Any) -> Any:
        """diffusers' own checkpoint call (non-reentrant), with the block set while the checkpoint keeps its inputs."""
        previous, self.block = self.block, self._block_of(module)
        try:
            return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)
        finally:
            self.block = previous


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The model with random weights created directly in bf16 (a float32 build would peak at twice the bytes)."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        if spec["model"] == "flux":
            config = {**FLUX_DEV, "num_layers": spec["double"], "num_single_layers": spec["single"]}
        else:
            config = REDUCED_SDXL_UNET if spec["model"] == "sdxl-reduced" else SDXL_UNET
        return build_published(config, "cpu")
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
        inputs: dict[str, Any] = {
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


def weight_gradient_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """The backward of the SDXL UNet's largest layer alone, on a minimal input: the bytes a weight's gradient holds
    while it is computed, the gradient memory a training step's peak can include when each is dropped as it lands."""
    torch.set_num_threads(spec["threads"])
    unet: Any = build_published(SDXL_UNET)
    kinds = (torch.nn.Conv2d, torch.nn.Linear)
    largest = max((m for m in unet.modules() if isinstance(m, kinds)), key=lambda m: m.weight.numel())
    layer = largest.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
            p.register_post_accumulate_grad_hook(_drop_grad)
    shape = (1, layer.in_channels, 8, 8) if isinstance(layer, torch.nn.Conv2d) else (1, 8, layer.in_features)
    loss = layer(torch.randn(*shape).to(torch.bfloat16)).float().sum()
    before = status_bytes("VmRSS")
    loss.backward()
    return {"layer": repr(layer), "weight_bytes": layer.weight.nbytes, "peak": status_bytes("VmHWM") - before}


def time_checkpointing(spec: dict[str, Any]) -> dict[str, Any]:
    """Training step times with checkpointing off and on (diffusers' own checkpoint function), alternating in one
    process so that whatever else runs on the machine slows both alike: medians of spec['steps'] rounds after a
    warm-up round."""
    torch.set_num_threads(spec["threads"])
    model: Any = build_model(spec)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_drop_grad)
    inputs, target = make_inputs(spec)
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(1 + spec["steps"]):
        for ckpt in (False, True):
            model.enable_gradient_checkpointing() if ckpt else model.disable_gradient_checkpointing()
            started = time.perf_counter()
            out = model(**inputs, return_dict=False)[0]
            F.mse_loss(out.float(), target.float()).backward()
            del out
            if round_:
                times[ckpt].append(time.perf_counter() - started)
    return {"off": statistics.median(times[False]), "on": statistics.median(times[True]), "load": os.getloadavg()[0]}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, run one step (autograd's saved bytes counted), report its memory.

    Modes: forward (no_grad), train (every parameter trainable, each gradient dropped as it lands), lora (the adapter
    trainable, its gradients kept) and adamw (every parameter trainable, gradients kept); lora and adamw end with one
    AdamW step and report the bytes of the gradients and of the optimizer state."""
    torch.set_num_threads(spec["threads"])
    model = build_model(spec)
    layers = 0
    if spec["mode"] == "lora":
        from stk.models import Family
        from stk.train.lora import LoraSettings, add_lora

        layers = add_lora(model, LoraSettings(rank=LORA_RANK), Family(spec["model"]), seed=0)
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
    if spec["mode"] == "forward":
        with torch.no_grad():
            model(**inputs)
    else:
        with saved.recording():
            out = model(**inputs, return_dict=False)[0]
            F.mse_loss(out.float(), target.float()).backward()
        del out
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
        "largest_block": max(saved.by_block.values(), default=0),
        "largest_tensor": saved.largest,
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
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
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


Runs = dict[tuple[str, bool, int], dict[str, Any]]  # (train | lora, checkpointing, resolution) -> measure()


def sdxl_spec(mode: str, checkpointing: bool, resolution: int, args: argparse.Namespace) -> dict:
    return {"model": "sdxl", "mode": mode, "checkpointing": checkpointing, "resolution": resolution,
            "steps": args.steps, "threads": args.threads}  # fmt: skip


def part_activations(args: argparse.Namespace, sdxl: Runs) -> None:
    """Part 1: the SDXL UNet's activations with and without checkpointing, each configuration in a fresh process,
    at --resolution (timed) and at half of it (to tell what grows with the image from what does not)."""
    res, half = args.resolution, args.resolution // 2
    base = run_child(sdxl_spec("forward", False, res, args))
    for size in (res, half):
        for ckpt in (False, True):
            sdxl[("train", ckpt, size)] = run_child(sdxl_spec("train", ckpt, size, args))
    off, on = sdxl[("train", False, res)], sdxl[("train", True, res)]
    print(f"\n## 1. Activations: SDXL UNet, {base['params']:,} parameters in bf16 (random weights), batch 1, "
          f"{args.threads} threads, one fresh process per configuration")  # fmt: skip
    print(f"{'configuration':<44}{'peak RSS':>10}{'model RSS':>11}{'step adds':>11}{'autograd saved':>16}"
          f"{'process':>9}")  # fmt: skip
    rows = [(f"{res} px forward under no_grad (baseline)", base)] + [
        (f"{size} px train step, checkpointing {'on' if ckpt else 'off'}", sdxl[("train", ckpt, size)])
        for size in (res, half) for ckpt in (False, True)
    ]  # fmt: skip
    for label, r in rows:
        saved = gb(sum(r["saved"].values())) if r["saved"] else "-"
        print(f"{label:<44}{gb(r['peak_rss']):>10}{gb(r['model_rss']):>11}{gb(r['peak_rss'] - r['model_rss']):>11}"
              f"{saved:>16}{r['wall_s']:>7.0f} s")  # fmt: skip
    target = TARGETS["activation_reduction"]
    wg = run_child({"model": "sdxl", "mode": "weight-grad", "threads": args.threads})
    grad = wg["peak"]
    act_off, act_on = off["peak_rss"] - base["peak_rss"] - grad, on["peak_rss"] - base["peak_rss"] - grad
    print(f"gradients held at the peak: each is dropped as it lands, so at most one is in flight; the backward of the "
          f"largest layer alone ({wg['layer']}, {wg['weight_bytes'] / 1e6:.0f} MB of bf16 weight) holds "
          f"{grad / 1e6:.0f} MB (its own process: a float32 gradient and its bf16 cast)")  # fmt: skip
    print(f"(a) train peak - baseline peak - that gradient, at {res} px: off {gb(act_off)}, on {gb(act_on)}: "
          f"{act_off / act_on:.1f}x (target >= {target:.0f}x): {verdict(act_off / act_on >= target)}")  # fmt: skip
    bf16 = off["largest_grad_bytes"]
    literal = (act_off + grad - bf16) / (act_on + grad - bf16)
    print(f"    less only the largest gradient's bf16 bytes ({bf16 / 1e6:.0f} MB) instead: {gb(act_off + grad - bf16)} "
          f"and {gb(act_on + grad - bf16)}: {literal:.1f}x ({verdict(literal >= target)})")  # fmt: skip
    grow_off = activation_bytes(off) - activation_bytes(sdxl[("train", False, half)])
    grow_on = activation_bytes(on) - activation_bytes(sdxl[("train", True, half)])
    print(f"(b) what grows with the image: the step's peak over the model, less the largest gradient, from {half} to "
          f"{res} px: off +{gb(grow_off)}, on +{gb(grow_on)}: {grow_off / grow_on:.1f}x (target >= {target:.0f}x): "
          f"{verdict(grow_off / grow_on >= target)}")  # fmt: skip
    # half the resolution is a quarter of the pixels: what grows is a third of the growth at `half`, the rest is fixed
    fixed = [activation_bytes(sdxl[("train", ck, half)]) - (grow_on if ck else grow_off) / 3 for ck in (False, True)]
    print(f"    the part that does not grow with the image ({gb(fixed[0])} off, {gb(fixed[1])} on, the largest bf16 "
          f"gradient already taken off) is sized by the weights: a weight gradient in flight")  # fmt: skip
    held_off = sum(off["saved"].values())
    held_on = sum(on["saved"].values()) + off["largest_block"]
    print(f"(c) autograd's own count at {res} px (exact; no working set): off {gb(held_off)} saved; on "
          f"{gb(sum(on['saved'].values()))} kept + {gb(off['largest_block'])} for the largest block while it is "
          f"recomputed = {gb(held_on)}: {held_off / held_on:.1f}x (target >= {target:.0f}x): "
          f"{verdict(held_off / held_on >= target)}")  # fmt: skip
    timed = run_child(sdxl_spec("time", False, res, args))
    cost = timed["on"] / timed["off"]
    print(f"step time at {res} px (forward + backward; off and on alternating in one process, median of {args.steps} "
          f"rounds after a warm-up round, load average {timed['load']:.1f}): off {timed['off']:.1f} s, on "
          f"{timed['on']:.1f} s: checkpointing costs {cost:.2f}x ({(cost - 1) * 100:+.0f}%; no target)")  # fmt: skip


def part_lora(args: argparse.Namespace, sdxl: Runs) -> None:
    """Part 2: gradients + AdamW state, LoRA rank 16 against full fine-tuning."""
    lora = sdxl[("lora", False, args.resolution)] = run_child(sdxl_spec("lora", False, args.resolution, args))
    reduced = run_child({**sdxl_spec("adamw", False, args.resolution // 2, args), "model": "sdxl-reduced"})
    full_params = lora["params"] - lora["trainable"]
    lora_bytes = lora["grad_bytes"] + lora["adamw_state_bytes"]
    per_param = (reduced["grad_bytes"] + reduced["adamw_state_bytes"]) / reduced["trainable"]
    full_bytes = per_param * full_params
    share = lora["trainable"] / full_params
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    print(f"\n## 2. Gradients + AdamW state: LoRA rank {LORA_RANK} against full fine-tuning, SDXL UNet")
    print(f"LoRA (stk.train.lora.add_lora): {lora['lora_layers']} layers adapted, {lora['trainable']:,} trainable "
          f"parameters ({lora['trainable_dtype']}) = {share * 100:.3f}% of the UNet's {full_params:,}")  # fmt: skip
    print(f"one real AdamW step on the full-width UNet with the adapter ({args.resolution} px, "
          f"{lora['wall_s']:.0f} s): gradients {lora['grad_bytes'] / 1e6:.1f} MB + AdamW state "
          f"{lora['adamw_state_bytes'] / 1e6:.1f} MB = {lora_bytes / 1e6:.1f} MB "
          f"({lora_bytes / lora['trainable']:.2f} B per trainable parameter)")  # fmt: skip
    print(f"full fine-tune: its step needs ~20 GB (weights, gradients and AdamW state in bf16), more than this "
          f"machine's {ram:.0f} GiB with the rest running, so one real AdamW step ran on a reduced UNet (full width, "
          f"transformer_layers_per_block [1, 1, 1]: {reduced['trainable']:,} parameters, "
          f"{reduced['trainable_dtype']}): gradients {gb(reduced['grad_bytes'])} + state "
          f"{gb(reduced['adamw_state_bytes'])} = {per_param:.2f} B per parameter, x {full_params:,} parameters = "
          f"{gb(full_bytes)} (computed, not measured)")  # fmt: skip
    ratio = lora_bytes / full_bytes
    print(f"LoRA / full: {ratio * 100:.3f}% (target <= {TARGETS['lora_vs_full'] * 100:.0f}%): "
          f"{verdict(ratio <= TARGETS['lora_vs_full'])}")  # fmt: skip
    ds = 2 + 4 + 4 + 4  # DeepSpeed bf16: bf16 gradient, fp32 master weight, fp32 Adam m and v
    print(f"under DeepSpeed bf16 ({ds} B per trainable parameter: bf16 gradient, fp32 master, m and v): LoRA "
          f"{gb(ds * lora['trainable'])}, full {gb(ds * full_params)}: {share * 100:.3f}%, the same ratio")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Part 3: the table


@dataclass(frozen=True)
class Activations:
    """One configuration's activation bytes on a GPU at the reference run's size, from the CPU measurements."""

    saved: float  # per sample: autograd's saved tensors at full depth (checkpointing: the blocks' kept inputs)
    recompute: float  # per sample: the largest block's saved tensors, held again while checkpointing recomputes it
    working: float  # per sample: 3 x the largest saved tensor, the gradients in flight in the backward (assumed)
    fixed: float  # per step: what the CPU step held beyond these and does not grow with the image

    def at(self, batch: int) -> float:
        return batch * (self.saved + self.recompute + self.working) + self.fixed


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
    from stk.models import Family
    from stk.train.lora import LoraSettings, add_lora

    model = build_published(config)
    sizes = [p.numel() for p in model.parameters()]
    add_lora(model, LoraSettings(rank=LORA_RANK), Family(name), seed=0)
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


def flux_runs(args: argparse.Namespace) -> tuple[Runs, dict[int, float], list[str]]:
    """One double and one single block at full width, at two sizes with 1024 px's 8:1 image:text token ratio."""
    sizes = {256: 32, 128: 8} if args.quick else {512: 128, 256: 32}  # resolution -> text tokens
    runs: Runs = {}
    for res, text in sizes.items():
        for mode in ("train", "lora"):
            for ckpt in (False, True):
                runs[(mode, ckpt, res)] = run_child(
                    {"model": "flux", "mode": mode, "checkpointing": ckpt, "resolution": res, "text_tokens": text,
                     "double": 1, "single": 1, "threads": args.threads})  # fmt: skip
    tokens = {res: (res // 16) ** 2 + text for res, text in sizes.items()}
    (big, small) = tokens
    lines = []
    for kind in ("double", "single"):
        a, b = runs[("train", False, small)]["saved"][kind], runs[("train", False, big)]["saved"][kind]
        lines.append(f"  a {kind} block saves {a / 1e6:.1f} MB at {tokens[small]} tokens, {b / 1e6:.1f} MB at "
                     f"{tokens[big]}: x{b / a:.2f} for x{tokens[big] / tokens[small]:.2f} tokens")  # fmt: skip
    return runs, {res: float(x) for res, x in tokens.items()}, lines


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
    buffers = 2 * zero["reduce_bucket_size"] * (2 if zero.get("overlap_comm") and stage < 3 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "buffers": buffers}


def sdpa_backward() -> str:
    """Which SDPA kernel autograd records on this machine: a flash kernel saves q, k, v, the output and logsumexp
    (memory linear in tokens); the math fallback would save the attention matrix (quadratic)."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    return type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__


def part_table(args: argparse.Namespace, sdxl: Runs) -> None:
    """Part 3: the memory table of the reference run."""
    from stk.train.dsconfig import load_deepspeed_config

    presets = {name: load_deepspeed_config(name) for name in PRESETS}
    threshold = presets["zero3"]["zero_optimization"]["stage3_param_persistence_threshold"]
    res, half = args.resolution, args.resolution // 2
    for size, ckpt in ((res, True), (half, False), (half, True)):
        sdxl[("lora", ckpt, size)] = run_child(sdxl_spec("lora", ckpt, size, args))
    flux, flux_tokens, flux_lines = flux_runs(args)
    sdxl_pixels = {size: float((size // 8) ** 2) for size in (res, half)}
    flux_depth = FLUX_DEV["num_layers"], FLUX_DEV["num_single_layers"]
    configs = [(mode, ckpt) for mode in ("full", "lora") for ckpt in (False, True)]
    models = [
        Model("Flux.1-dev", *counts("flux", FLUX_DEV, threshold), {(mode, ckpt): estimate(
            flux, "train" if mode == "full" else "lora", ckpt, flux_tokens, (RESOLUTION // 16) ** 2 + FLUX_TEXT_TOKENS,
            lambda s: s.get("other", 0) + flux_depth[0] * s["double"] + flux_depth[1] * s["single"],
        ) for mode, ckpt in configs}),
        Model("SDXL UNet", *counts("sdxl", SDXL_UNET, threshold), {(mode, ckpt): estimate(
            sdxl, "train" if mode == "full" else "lora", ckpt, sdxl_pixels, (RESOLUTION // 8) ** 2,
            lambda s: sum(s.values()),
        ) for mode, ckpt in configs}),
    ]  # fmt: skip
    budget = GPU_BYTES * (1 - HEADROOM)
    print(f"\n## 3. Per-GPU memory at {RESOLUTION} px, batch {BATCH} per GPU, {GPUS} GPUs, bf16 DeepSpeed")
    print(f"Flux: 1 double + 1 single block at full width, measured at {sorted(flux_tokens.values())} tokens "
          f"(image + text, 8:1 as at {RESOLUTION} px), extrapolated to {(RESOLUTION // 16) ** 2} + {FLUX_TEXT_TOKENS} "
          f"tokens and to {flux_depth[0]} double + {flux_depth[1]} single blocks; linearity:")  # fmt: skip
    for line in flux_lines:
        print(line)
    saved = {size: gb(sum(sdxl[("train", False, size)]["saved"].values())) for size in (half, res)}
    print(f"SDXL: the whole UNet at {half} and {res} px, extrapolated in latent pixels to {RESOLUTION // 8}x"
          f"{RESOLUTION // 8}; saved at {half} px {saved[half]}, at {res} px {saved[res]} (x4 pixels, the "
          f"{SDXL_TEXT_TOKENS} text tokens fixed)")  # fmt: skip
    print(f"attention: the CPU's SDPA records {sdpa_backward()} (saves q, k, v, output, logsumexp: linear in tokens, "
          "as flash/memory-efficient SDPA on a GPU)")  # fmt: skip
    print("activations per GPU = batch x (saved + recompute + working) + fixed; per sample at 1024 px:")
    for m in models:
        for (mode, ckpt), a in m.activations.items():
            print(f"  {m.name:<11}{mode:<5}ckpt {'on ' if ckpt else 'off'}: saved {gb(a.saved)}, recompute "
                  f"{gb(a.recompute)}, working {gb(a.working)}; fixed {gb(a.fixed)} per step -> {gb(a.at(BATCH))} "
                  f"at batch {BATCH}")  # fmt: skip
    print(f"{models[0].name}: {models[0].params:,} parameters; {models[1].name}: {models[1].params:,}; LoRA rank "
          f"{LORA_RANK}: {models[0].lora:,} and {models[1].lora:,}")  # fmt: skip
    print(f"fits: total <= {budget / GB:.0f} GB ({GPU_BYTES / GB:.0f} GB less {HEADROOM * 100:.0f}% for the CUDA "
          "context, NCCL and fragmentation). GB = 10^9 bytes.\n")  # fmt: skip
    print("| model | mode | ckpt | preset | weights | grads | optimizer | buffers | activations | total | fits |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    best: dict[tuple[str, str, bool], str] = {}
    for m in models:
        for mode, ckpt in configs:
            for preset in PRESETS:
                states = zero_states(m, mode == "lora", presets[preset])
                act = m.activations[(mode, ckpt)].at(BATCH)
                total = sum(states.values()) + act
                if total <= budget:
                    best.setdefault((m.name, mode, ckpt), preset)
                cells = " | ".join(f"{c / GB:.1f}" for c in [*states.values(), act, total])
                fits = "yes" if total <= budget else "no"
                print(f"| {m.name} | {mode} | {'on' if ckpt else 'off'} | {preset} | {cells} | {fits} |")
    print("\nthe lowest-overhead preset that fits (in order: " + ", ".join(PRESETS) + "):")
    for m in models:
        for mode in ("full", "lora"):
            print(f"  {m.name}, {mode}: " + "; ".join(
                f"checkpointing {'on' if ck else 'off'}: {best.get((m.name, mode, ck), 'none fits')}"
                for ck in (False, True)))  # fmt: skip
    for m in models:
        host = 16 * m.params / GPUS
        print(f"zero2-offload's host memory for {m.name} full (fp32 master, m, v and gradient, 16 B per trainable "
              f"parameter / {GPUS}): {gb(host)} per GPU, {gb(8 * host)} per 8-GPU node")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", type=int, default=256, help="SDXL's measured resolution in px (multiple of 32)")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (off and on) after a warm-up round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (OMP_NUM_THREADS) per process")
    parser.add_argument("--table", action="store_true", help="also the per-GPU memory table of the reference run")
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 px, one timed step, Flux at 256 px")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        child = {"weight-grad": weight_gradient_peak, "time": time_checkpointing}.get(spec["mode"], measure)
        print(json.dumps(child(spec)))
        return
    if args.quick:
        args.resolution, args.steps = 128, 1
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    print(f"# bench/memory.py on {platform.node()}: {os.cpu_count()} cores, {ram:.0f} GiB RAM, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    sdxl: Runs = {}
    part_activations(args, sdxl)
    part_lora(args, sdxl)
    if args.table:
        part_table(args, sdxl)


if __name__ == "__main__":
    main()
