"""The reference run on paper: each flow family's published denoiser fully fine-tuned at 1024 px on 32 H100s, batch 8
per GPU, with gradient checkpointing (which full fine-tuning of these models needs at that batch: bench/memory.py
--table). FLOPs per step and GPU are counted by torch.utils.flop_counter on the meta device from the published
config (the forward, its backward, and checkpointing's second forward); a step's seconds follow at a given MFU of the
H100's dense bf16 peak. No GPU and no weights: the counts are exact for the shapes, the seconds are what the MFU
assumes, and bench/gpu.py measures the MFU a GPU reaches.

    python bench/projection.py [--configs flux-dev,flux2-dev] [--mfu 0.4] [--batch 8] [--gpus 32] [--comm]

--comm adds, per config, ZeRO-2's communication on the reference fabric (`zero_comm`: the formula, its figures in
`Fabric`) for each candidate bucket size with overlap_comm on and off: the seconds a step waits on it and the
buffers DeepSpeed holds for it. The presets' bucket size is the smallest whose exposed seconds stay within 1% of
the step of the largest's: the rest of the memory goes to the batch.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from denoisers import REFERENCE_RESOLUTION, TITLES, denoiser_of, flow_configs, step_inputs, training_forward
from memory_table import bucket_bytes
from torch.fx.experimental import _config as fx_config
from torch.utils.flop_counter import FlopCounterMode

from stk.models.published import build_published, published_config

H100_BF16_TFLOPS = 989.4  # dense, SXM (bench/gpu_setup.py's table)


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The reference cluster's links: 4 nodes of 8 H100 SXM, NVLink inside a node, eight 400 Gb/s InfiniBand
    ports per node (one per GPU). A ring over all 32 GPUs crosses the nodes, so its bus bandwidth is the
    InfiniBand port's 50 GB/s, not NVLink's 450 GB/s; each collective also pays a start-up latency across the
    ring."""

    bus_gbps: float = 50.0  # GB/s per GPU each way: 400 Gb/s
    latency_s: float = 3e-4  # per collective over 32 ranks (about 2 x 31 hops of ~5 us)


REFERENCE_FABRIC = Fabric()


def zero_comm(
    trainable: int, gpus: int, bucket: int, overlap: bool, fabric: Fabric = REFERENCE_FABRIC
) -> dict[str, float]:
    """A ZeRO-1/2 step's communication on `gpus` ranks, bf16 (2 bytes an element), buckets of `bucket` elements
    (reduce_bucket_size = allgather_bucket_size): the `trainable` elements' gradients reduce-scattered bucket by
    bucket in the backward, then the updated parameters all-gathered after the optimizer step. With overlap_comm a
    bucket reduces while the backward computes the next, so only the last bucket's reduction is exposed; the
    all-gather is always exposed (the next forward needs the parameters). What each GPU sends in a ring:
    (gpus - 1) / gpus of the tensor. DeepSpeed's buffers for it: memory_table.bucket_bytes."""
    share = (gpus - 1) / gpus
    bandwidth = fabric.bus_gbps * 1e9

    def collectives(elements: int) -> int:
        return -(-elements // bucket)

    one_way = collectives(trainable) * fabric.latency_s + share * trainable * 2 / bandwidth
    reduce_exposed = fabric.latency_s + share * min(trainable, bucket) * 2 / bandwidth if overlap else one_way
    buffers = bucket_bytes({"stage": 2, "reduce_bucket_size": bucket, "overlap_comm": overlap})
    return {"reduce_s": one_way, "exposed_s": reduce_exposed + one_way, "buffer_bytes": buffers}


def forward_backward_flops(config: str) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one sample's training step at 1024 px, on the meta device."""
    denoiser_config = published_config(config, "denoiser")
    model = build_published(denoiser_config, "meta").to(torch.bfloat16)
    on_cpu = step_inputs(config, denoiser_config, REFERENCE_RESOLUTION, denoiser_of(config).text_tokens, torch.bfloat16)
    inputs = dataclasses.replace(
        on_cpu, latents=on_cpu.latents.to("meta"), text={k: v.to("meta") for k, v in on_cpu.text.items()}
    )
    counted = []
    for backward in (False, True):
        # a family that drops padded text tokens by mask indexes with it: on meta, every token counts as real
        with (
            FlopCounterMode(display=False) as counter,
            fx_config.patch(meta_nonzero_assume_all_nonzero=True),
            torch.set_grad_enabled(backward),
        ):
            prediction, target = training_forward(config, model, inputs)
            loss = F.mse_loss(prediction.float(), target.float())
            if backward:
                loss.backward()
        counted.append(int(counter.get_total_flops()))
    return counted[0], counted[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs", default=",".join(flow_configs()), help="published configs (stk/models/families/*/configs)"
    )
    parser.add_argument("--mfu", type=float, default=0.4, help="the fraction of the peak a step is assumed to reach")
    parser.add_argument("--batch", type=int, default=8, help="samples per GPU and step")
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="dense bf16 peak of one GPU")
    parser.add_argument("--comm", action="store_true", help="ZeRO-2's communication per bucket size (zero_comm)")
    args = parser.parse_args()
    rate = args.mfu * args.peak_tflops * 1e12
    print(
        f"full fine-tuning at {REFERENCE_RESOLUTION} px, batch {args.batch} per GPU on {args.gpus} GPUs, "
        f"checkpointing on; seconds at {args.mfu:.0%} MFU of {args.peak_tflops} TFLOPS"
    )
    print(
        "| denoiser | parameters | PFLOP per sample (fwd + bwd + recompute) | PFLOP per GPU and step | s/step | "
        "images/s on all GPUs |"
    )
    print("|---|---|---|---|---|---|")
    steps: dict[str, tuple[int, float]] = {}
    for config in args.configs.split(","):
        forward, step = forward_backward_flops(config)
        per_sample = step + forward  # checkpointing runs each block's forward again in the backward
        per_gpu = per_sample * args.batch
        seconds = per_gpu / rate
        params = sum(p.numel() for p in build_published(published_config(config, "denoiser"), "meta").parameters())
        title = TITLES.get(config, config)
        print(
            f"| {title} | {params / 1e9:.1f}B | {per_sample / 1e15:.2f} | {per_gpu / 1e15:.1f} | {seconds:.2f} | "
            f"{args.batch * args.gpus / seconds:.1f} |"
        )
        steps[title] = (params, seconds)
    if args.comm:
        for title, (params, seconds) in steps.items():
            print_comm(title, params, seconds, args.gpus)


BUCKETS = (50_000_000, 100_000_000, 200_000_000, 500_000_000)  # elements; DeepSpeed's default is 5e8


def chosen_bucket(trainable: int, gpus: int, step_s: float) -> int:
    """The smallest bucket whose exposed communication (overlap_comm on) is within 1% of the step of the largest
    bucket's."""
    best = zero_comm(trainable, gpus, BUCKETS[-1], overlap=True)["exposed_s"]
    return next(b for b in BUCKETS if zero_comm(trainable, gpus, b, overlap=True)["exposed_s"] <= best + 0.01 * step_s)


def print_comm(title: str, trainable: int, step_s: float, gpus: int) -> None:
    print(f"\n{title}, full fine-tune, ZeRO-2 on {gpus} GPUs ({REFERENCE_FABRIC}); compute {step_s:.2f} s/step")
    print("| bucket (elements) | overlap_comm | reduce s | exposed s | exposed / step | buffers GB |")
    print("|---|---|---|---|---|---|")
    for bucket in BUCKETS:
        for overlap in (True, False):
            comm = zero_comm(trainable, gpus, bucket, overlap)
            cells = [
                f"{bucket:.0e}",
                overlap,
                f"{comm['reduce_s']:.3f}",
                f"{comm['exposed_s']:.3f}",
                f"{comm['exposed_s'] / step_s:.1%}",
                f"{comm['buffer_bytes'] / 1e9:.1f}",
            ]
            print("| " + " | ".join(map(str, cells)) + " |")
    print(f"chosen bucket: {chosen_bucket(trainable, gpus, step_s):.0e} elements")


if __name__ == "__main__":
    main()
