"""The reference run on paper: each flow family's published denoiser fully fine-tuned at 1024 px on 32 H100s, batch 8
per GPU, with gradient checkpointing (which full fine-tuning of these models needs at that batch: bench/memory.py
--table). FLOPs per step and GPU are counted by torch.utils.flop_counter on the meta device from the published
config (the forward, its backward, and checkpointing's second forward); a step's seconds follow at a given MFU of the
H100's dense bf16 peak. No GPU and no weights: the counts are exact for the shapes, the seconds are what the MFU
assumes, and bench/gpu.py measures the MFU a GPU reaches.

    python bench/projection.py [--configs flux-dev,flux2-dev] [--mfu 0.4] [--batch 8] [--gpus 32]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from denoisers import REFERENCE_RESOLUTION, TITLES, denoiser_of, flow_configs, step_inputs, training_forward
from torch.fx.experimental import _config as fx_config
from torch.utils.flop_counter import FlopCounterMode

from stk.models.published import build_published, published_config

H100_BF16_TFLOPS = 989.4  # dense, SXM (bench/gpu_setup.py's table)


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
    parser.add_argument("--configs", default=",".join(flow_configs()), help="published configs (stk/models/configs)")
    parser.add_argument("--mfu", type=float, default=0.4, help="the fraction of the peak a step is assumed to reach")
    parser.add_argument("--batch", type=int, default=8, help="samples per GPU and step")
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="dense bf16 peak of one GPU")
    args = parser.parse_args()
    rate = args.mfu * args.peak_tflops * 1e12
    print(f"full fine-tuning at {REFERENCE_RESOLUTION} px, batch {args.batch} per GPU on {args.gpus} GPUs, "
          f"checkpointing on; seconds at {args.mfu:.0%} MFU of {args.peak_tflops} TFLOPS")  # fmt: skip
    print("| denoiser | parameters | PFLOP per sample (fwd + bwd + recompute) | PFLOP per GPU and step | s/step | "
          "images/s on all GPUs |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for config in args.configs.split(","):
        forward, step = forward_backward_flops(config)
        per_sample = step + forward  # checkpointing runs each block's forward again in the backward
        per_gpu = per_sample * args.batch
        seconds = per_gpu / rate
        params = sum(p.numel() for p in build_published(published_config(config, "denoiser"), "meta").parameters())
        title = TITLES.get(config, config)
        print(f"| {title} | {params / 1e9:.1f}B | {per_sample / 1e15:.2f} | {per_gpu / 1e15:.1f} | {seconds:.2f} | "
              f"{args.batch * args.gpus / seconds:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
