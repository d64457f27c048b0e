"""Benchmark the memory stk-train's options buy: gradient checkpointing, LoRA, and the DeepSpeed ZeRO presets.

    python bench/memory.py [--resolution 256] [--steps 3] [--threads 2] [--table [--configs A,B]] [--quick]

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
  2. Gradients + AdamW state of LoRA rank 16 (stk.train.trainable.lora.add_lora) against full fine-tuning: one
     real AdamW step on the full-width UNet with the adapter; full fine-tuning does not fit this machine's RAM (5 GB
     weights, 5 GB gradients, 10 GB state), so its real step runs on a reduced UNet (full width, one transformer layer
     per block) and the bytes per parameter it measures are scaled to the full UNet's exact parameter count.
     Target: <= 2%.
  3. --table: per-GPU memory of every flow family's published config (stk.models.published; --configs names some)
     and the SDXL UNet at 1024 px, batch 8 per GPU, on 32 GPUs, for each preset in stk/train/deepspeed/presets,
     checkpointing off and on, full fine-tune and LoRA, bf16 under DeepSpeed, and the largest batch that fits. Model
     states: the ZeRO paper's accounting and the presets' bucket sizes. Activations: autograd's count at two sizes
     (a transformer: one block of each kind at full width, bench/denoisers.py, at 256 and 512 px with the text
     tokens in 1024 px's ratio, Flux 32 and 128; SDXL: the whole UNet at --resolution and half), through the
     family's own denoise (its spec), extrapolated linearly in tokens (PyTorch's SDPA keeps attention
     linear, on this CPU as with flash attention on a GPU) and scaled to the full depth; plus, with checkpointing,
     the largest block's saved tensors while it is recomputed; plus 3x the largest saved tensor for the gradients
     in flight (an assumption); plus what the CPU step held beyond all that (not scaled: it does not grow).

The script always exits 0: it is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch
from memory_common import LORA_RANK, Runs, activation_bytes, gb, run_child, sdxl_spec
from memory_measure import measure, time_checkpointing, weight_gradient_peak
from memory_table import part_table

TARGETS = {"activation_reduction": 3.0, "lora_vs_full": 0.02}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def part_activations(args: argparse.Namespace, sdxl: Runs) -> None:
    """Part 1: the SDXL UNet's activations with and without checkpointing, each configuration in a fresh process,
    at --resolution (timed) and at half of it (to tell what grows with the image from what does not)."""
    res, half = args.resolution, args.resolution // 2
    base = run_child(sdxl_spec("forward", False, res, args))
    for size in (res, half):
        for ckpt in (False, True):
            sdxl[("train", ckpt, size)] = run_child(sdxl_spec("train", ckpt, size, args))
    off, on = sdxl[("train", False, res)], sdxl[("train", True, res)]
    print(
        f"\n## 1. Activations: SDXL UNet, {base['params']:,} parameters in bf16 (random weights), batch 1, "
        f"{args.threads} threads, one fresh process per configuration"
    )
    print(
        f"{'configuration':<44}{'peak RSS':>10}{'model RSS':>11}{'step adds':>11}{'autograd saved':>16}{'process':>9}"
    )
    rows = [(f"{res} px forward under no_grad (baseline)", base)] + [
        (f"{size} px train step, checkpointing {'on' if ckpt else 'off'}", sdxl[("train", ckpt, size)])
        for size in (res, half)
        for ckpt in (False, True)
    ]
    for label, r in rows:
        saved = gb(sum(r["saved"].values())) if r["saved"] else "-"
        print(
            f"{label:<44}{gb(r['peak_rss']):>10}{gb(r['model_rss']):>11}{gb(r['peak_rss'] - r['model_rss']):>11}"
            f"{saved:>16}{r['wall_s']:>7.0f} s"
        )
    target = TARGETS["activation_reduction"]
    wg = run_child({"model": "sdxl", "mode": "weight-grad", "threads": args.threads})
    grad = wg["peak"]
    act_off, act_on = off["peak_rss"] - base["peak_rss"] - grad, on["peak_rss"] - base["peak_rss"] - grad
    print(
        f"gradients held at the peak: each is dropped as it lands, so at most one is in flight; the backward of the "
        f"largest layer alone ({wg['layer']}, {wg['weight_bytes'] / 1e6:.0f} MB of bf16 weight) holds "
        f"{grad / 1e6:.0f} MB (its own process: a float32 gradient and its bf16 cast)"
    )
    print(
        f"(a) train peak - baseline peak - that gradient, at {res} px: off {gb(act_off)}, on {gb(act_on)}: "
        f"{act_off / act_on:.1f}x (target >= {target:.0f}x): {verdict(act_off / act_on >= target)}"
    )
    bf16 = off["largest_grad_bytes"]
    literal = (act_off + grad - bf16) / (act_on + grad - bf16)
    print(
        f"    less only the largest gradient's bf16 bytes ({bf16 / 1e6:.0f} MB) instead: {gb(act_off + grad - bf16)} "
        f"and {gb(act_on + grad - bf16)}: {literal:.1f}x ({verdict(literal >= target)})"
    )
    grow_off = activation_bytes(off) - activation_bytes(sdxl[("train", False, half)])
    grow_on = activation_bytes(on) - activation_bytes(sdxl[("train", True, half)])
    print(
        f"(b) what grows with the image: the step's peak over the model, less the largest gradient, from {half} to "
        f"{res} px: off +{gb(grow_off)}, on +{gb(grow_on)}: {grow_off / grow_on:.1f}x (target >= {target:.0f}x): "
        f"{verdict(grow_off / grow_on >= target)}"
    )
    # half the resolution is a quarter of the pixels: what grows is a third of the growth at `half`, the rest is fixed
    fixed = [activation_bytes(sdxl[("train", ck, half)]) - (grow_on if ck else grow_off) / 3 for ck in (False, True)]
    print(
        f"    the part that does not grow with the image ({gb(fixed[0])} off, {gb(fixed[1])} on, the largest bf16 "
        f"gradient already taken off) is sized by the weights: a weight gradient in flight"
    )
    held_off = sum(off["saved"].values())
    held_on = sum(on["saved"].values()) + off["largest_block"]
    print(
        f"(c) autograd's own count at {res} px (exact; no working set): off {gb(held_off)} saved; on "
        f"{gb(sum(on['saved'].values()))} kept + {gb(off['largest_block'])} for the largest block while it is "
        f"recomputed = {gb(held_on)}: {held_off / held_on:.1f}x (target >= {target:.0f}x): "
        f"{verdict(held_off / held_on >= target)}"
    )
    timed = run_child(sdxl_spec("time", False, res, args))
    cost = timed["on"] / timed["off"]
    print(
        f"step time at {res} px (forward + backward; off and on alternating in one process, median of {args.steps} "
        f"rounds after a warm-up round, load average {timed['load']:.1f}): off {timed['off']:.1f} s, on "
        f"{timed['on']:.1f} s: checkpointing costs {cost:.2f}x ({(cost - 1) * 100:+.0f}%; no target)"
    )


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
    print(
        f"LoRA (stk.train.trainable.lora.add_lora): {lora['lora_layers']} layers adapted, "
        f"{lora['trainable']:,} trainable parameters ({lora['trainable_dtype']}) = {share * 100:.3f}% of the UNet's "
        f"{full_params:,}"
    )
    print(
        f"one real AdamW step on the full-width UNet with the adapter ({args.resolution} px, "
        f"{lora['wall_s']:.0f} s): gradients {lora['grad_bytes'] / 1e6:.1f} MB + AdamW state "
        f"{lora['adamw_state_bytes'] / 1e6:.1f} MB = {lora_bytes / 1e6:.1f} MB "
        f"({lora_bytes / lora['trainable']:.2f} B per trainable parameter)"
    )
    print(
        f"full fine-tune: its step needs ~20 GB (weights, gradients and AdamW state in bf16), more than this "
        f"machine's {ram:.0f} GiB with the rest running, so one real AdamW step ran on a reduced UNet (full width, "
        f"transformer_layers_per_block [1, 1, 1]: {reduced['trainable']:,} parameters, "
        f"{reduced['trainable_dtype']}): gradients {gb(reduced['grad_bytes'])} + state "
        f"{gb(reduced['adamw_state_bytes'])} = {per_param:.2f} B per parameter, x {full_params:,} parameters = "
        f"{gb(full_bytes)} (computed, not measured)"
    )
    ratio = lora_bytes / full_bytes
    print(
        f"LoRA / full: {ratio * 100:.3f}% (target <= {TARGETS['lora_vs_full'] * 100:.0f}%): "
        f"{verdict(ratio <= TARGETS['lora_vs_full'])}"
    )
    ds = 2 + 4 + 4 + 4  # DeepSpeed bf16: bf16 gradient, fp32 master weight, fp32 Adam m and v
    print(
        f"under DeepSpeed bf16 ({ds} B per trainable parameter: bf16 gradient, fp32 master, m and v): LoRA "
        f"{gb(ds * lora['trainable'])}, full {gb(ds * full_params)}: {share * 100:.3f}%, the same ratio"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", type=int, default=256, help="SDXL's measured resolution in px (multiple of 32)")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (off and on) after a warm-up round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (OMP_NUM_THREADS) per process")
    parser.add_argument("--table", action="store_true", help="also the per-GPU memory table of the reference run")
    parser.add_argument("--quick", action="store_true", help="smoke: 128 px, one timed step, transformers at 256 px")
    parser.add_argument("--configs", help="the table's flow configs, comma-separated (default: every one published)")
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
    print(
        f"# bench/memory.py on {platform.node()}: {os.cpu_count()} cores, {ram:.0f} GiB RAM, torch "
        f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    sdxl: Runs = {}
    part_activations(args, sdxl)
    part_lora(args, sdxl)
    if args.table:
        part_table(args, sdxl)


if __name__ == "__main__":
    main()
