"""stk-train's step beside the diffusers examples' plain loops, counted in ops on the CPU (bench/opcount.py).

    python bench/overhead.py [--configs sdxl,flux-dev,...] [--presets zero1,zero2,zero3] [--variants full,lora]
                             [--steps 3] [--resolution 256] [--record]

Each family's published denoiser at its published depth (every block, so every tensor a real run has) but narrow
widths (32 to 64 channels), so a step takes a second on a CPU core. Per config, variant and preset it runs:

  stk    the step stk-train runs (stk.train.step.train_step on its DeepSpeed engine, this process a world of one rank,
         bf16), the family's objective on a cached batch;
  plain  the example's own loop on the same model and batch: for a full fine-tune fp32 weights under bf16 autocast
         (train_text_to_image_sdxl.py and the dreambooth scripts), for LoRA the frozen base in bf16 and the adapter's
         parameters in fp32 (cast_training_params), both with fused AdamW and a foreach clip_grad_norm_.

and prints, per steady step (after two warm-up steps): kernel ops, views, allocations and host syncs of each, the ratio
stk / plain of the ops (targets: <= 1.05x LoRA, <= 1.10x full under ZeRO-1/2, <= 1.3x under ZeRO-3) and of the CPU
seconds, and the ops stk dispatches most beyond the plain loop. `--record` puts the table into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from denoisers import denoiser_of, full_depth, text_inputs
from opcount import OpCount, count_ops

from stk.models import build_tiny_model
from stk.models.published import PUBLISHED, build_published, published_config

CONFIGS = ("sdxl", "flux-dev", "flux2-klein-4b", "qwen-image")
PRESETS = ("zero1", "zero2", "zero3")
VARIANTS = ("full", "lora")
LORA_RANK = 16
TARGETS = {("lora", False): 1.05, ("full", False): 1.10, ("lora", True): 1.3, ("full", True): 1.3}  # (_, zero3)

# narrow widths at the published depth: 32 channels a token for the transformers, 32/64/64 for the SDXL UNet
_TRANSFORMER = {"num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 32}
NARROW: dict[str, dict[str, Any]] = {
    "sdxl": {
        "block_out_channels": [32, 64, 64],
        "attention_head_dim": [2, 4, 4],
        "cross_attention_dim": 64,
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + 1280,
    },
    "flux-dev": {**_TRANSFORMER, "axes_dims_rope": [4, 6, 6], "pooled_projection_dim": 32},
    "flux2-klein-4b": {**_TRANSFORMER, "axes_dims_rope": [4, 4, 4, 4]},
    "qwen-image": {**_TRANSFORMER, "axes_dims_rope": [4, 6, 6]},
}


def narrow_model(config: str, folder: Path) -> str:
    """A pipeline folder of the family's tiny parts with `config`'s denoiser at full depth, narrow widths (and the
    latent channels of the tiny VAE)."""
    from stk.models.families import spec_for

    family = PUBLISHED[config]
    model = build_tiny_model(family, str(folder))
    subfolder = folder / spec_for(family).denoiser.subfolder
    tiny = json.loads((subfolder / "config.json").read_text())
    channels = {key: tiny[key] for key in ("in_channels", "out_channels") if key in tiny}
    overrides = {**NARROW[config], **full_depth(config), **channels}
    build_published(published_config(config, "denoiser", **overrides), "cpu").save_pretrained(str(subfolder))
    return model


def cached_batch(config: str, model: str, resolution: int) -> Any:
    """One sample as the cache hands it to stk-train: the VAE's latent mean and the text embeddings."""
    from stk.models.components import latent_channels
    from stk.models.model_json import scale_factor_of
    from stk.train.data.batch import Batch
    from stk.train.objective.objectives import objective_for

    family = PUBLISHED[config]
    objective = objective_for(family, model)
    g = torch.Generator().manual_seed(1)
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    side = resolution // scale_factor_of(vae)
    text = text_inputs(config, objective.denoiser_config(), denoiser_of(config).text_tokens, 1, g)
    return Batch(
        keys=["0"],
        original_size=torch.tensor([[resolution, resolution]]),
        crop_top_left=torch.tensor([[0, 0]]),
        mean=torch.randn(1, latent_channels(vae), side, side, generator=g),
        text=text,
    )


def one_rank_world() -> Iterator[None]:
    """This process as a torch.distributed world of one rank, started as stk-train starts it."""
    from stk.cluster.slurm import free_port
    from stk.train.deepspeed.distributed import DistEnv, init_distributed

    with mock.patch.dict(os.environ, DS_ACCELERATOR="cpu"):
        init_distributed(DistEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "here"), backend="gloo")
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def stk_step(
    config: str, model: str, variant: str, preset: str, batch: Any, zero: dict[str, Any] | None = None
) -> Callable[[int], None]:
    """stk-train's optimizer step `step` (train_step on its engine), as stk.train.setup builds it; `zero` overrides
    keys of the preset's zero_optimization."""
    from stk.cluster.world import World
    from stk.models.latents import LatentNorm
    from stk.train.deepspeed.config import load_deepspeed_config, zero_stage
    from stk.train.deepspeed.engine import build_engine, engine_config
    from stk.train.objective.objectives import objective_for
    from stk.train.options import TrainOptions
    from stk.train.step import StepModel, train_step
    from stk.train.trainable.kinds import trainable_for
    from stk.train.trainable.lora import LoraSettings

    lora = LoraSettings(rank=LORA_RANK if variant == "lora" else 0)
    opts = TrainOptions(model=model, output_dir=tempfile.mkdtemp(), batch_size=1, lora=lora)
    objective = objective_for(PUBLISHED[config], model)
    deepspeed_config = load_deepspeed_config(preset)
    deepspeed_config["zero_optimization"].update(zero or {})
    engine_settings = engine_config(opts, deepspeed_config, "bf16")
    zero3 = engine_settings if zero_stage(engine_settings) == 3 else None
    denoiser = objective.load_denoiser(torch.bfloat16, World() if zero3 else None, zero3)
    trainable_for(opts).add(denoiser, objective, 0)
    engine = build_engine(denoiser, opts, engine_settings, "bf16", total_steps=100)
    step_model = StepModel(objective, engine, None, torch.device("cpu"), torch.bfloat16, LatentNorm(1.0))

    def step(n: int) -> None:
        train_step(step_model, iter([batch]), n, 0, 0, 1, 1)

    return step


def plain_step(config: str, model: str, variant: str, batch: Any) -> Callable[[int], None]:
    """The example's loop: fp32 weights under bf16 autocast (full), or a bf16 base with the adapter in fp32 (LoRA)."""
    from stk.models.latents import LatentNorm
    from stk.train.objective.objectives import objective_for
    from stk.train.step import StepModel, step_generator, step_inputs
    from stk.train.trainable.lora import LoraSettings, add_lora

    family = PUBLISHED[config]
    objective = objective_for(family, model)
    weights = torch.float32 if variant == "full" else torch.bfloat16
    denoiser = objective.load_denoiser(weights)
    if variant == "lora":
        denoiser.requires_grad_(False)
        add_lora(denoiser, LoraSettings(rank=LORA_RANK), family, 0)
        for p in denoiser.parameters():  # diffusers' cast_training_params
            if p.requires_grad:
                p.data = p.data.float()
    if hasattr(denoiser, "enable_gradient_checkpointing"):
        denoiser.enable_gradient_checkpointing()  # stk-train's default, so both recompute alike
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    inputs_of = StepModel(objective, None, None, torch.device("cpu"), weights, LatentNorm(1.0))

    def step(n: int) -> None:
        generator = step_generator(0, n, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective.loss(denoiser, step_inputs(batch, inputs_of, generator), generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


WARM_UP_STEPS = 2  # the optimizer's state is made in the first; ZeRO-3 records its parameter trace in the first and
# checks it against every rank's in the second (a host sync per parameter, once a run): the third is the steady step


def count_step(step: Callable[[int], None]) -> OpCount:
    """The ops of one steady step: after the warm-up steps."""
    for n in range(WARM_UP_STEPS):
        step(n)
    return count_ops(lambda: step(WARM_UP_STEPS))


def measure(step: Callable[[int], None], steps: int) -> tuple[OpCount, float]:
    """The ops of one steady step, and the median CPU seconds a step."""
    counted = count_step(step)
    seconds = []
    for n in range(WARM_UP_STEPS + 1, WARM_UP_STEPS + 1 + steps):
        start = time.process_time()
        step(n)
        seconds.append(time.process_time() - start)
    return counted, sorted(seconds)[len(seconds) // 2]


def row(config: str, variant: str, preset: str, stk: tuple[OpCount, float], plain: tuple[OpCount, float]) -> dict:
    (s, s_time), (p, p_time) = stk, plain
    target = TARGETS[(variant, preset == "zero3")]
    return {
        "config": config,
        "variant": variant,
        "preset": preset,
        "ops_stk": s.ops,
        "ops_plain": p.ops,
        "ops_ratio": round(s.ops / p.ops, 3),
        "target": target,
        "met": s.ops / p.ops <= target,
        "views_stk": s.views,
        "views_plain": p.views,
        "allocs_stk": s.allocations,
        "allocs_plain": p.allocations,
        "syncs_stk": s.syncs,
        "syncs_plain": p.syncs,
        "cpu_s_ratio": round(s_time / p_time, 2),
        "beyond_plain": s.beyond(p, top=6),
    }


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"## CPU op count per step, stk-train against the examples' plain loops ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        "| config | variant | preset | ops stk | ops plain | stk / plain | target | views stk / plain | syncs stk "
        "/ plain | CPU s stk / plain | most beyond the plain loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        beyond = ", ".join(f"{name} +{n}" for name, n in r["beyond_plain"])
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['preset']} | {r['ops_stk']:,} | {r['ops_plain']:,} | "
            f"{r['ops_ratio']:.2f}x | {r['target']}x {'met' if r['met'] else 'NOT met'} | "
            f"{r['views_stk']:,} / {r['views_plain']:,} | {r['syncs_stk']} / {r['syncs_plain']} | "
            f"{r['cpu_s_ratio']:.2f}x | {beyond} |"
        )
    return "\n".join(lines) + "\n"


def record(text: str) -> None:
    """Into bench/RESULTS.md, newest on top (after the title and its paragraph)."""
    results = Path(__file__).resolve().parent / "RESULTS.md"
    head, sep, rest = results.read_text().partition("\n## ")
    results.write_text(f"{head}\n{text}\n{sep.lstrip(chr(10))}{rest}")


def measure_variant(config: str, variant: str, presets: list[str], steps: int, resolution: int) -> None:
    """One config and variant, each row printed as JSON: in a process of its own, since ZeRO-3's initialisation
    leaves its state behind (with DeepSpeed's default config, torch's linear replaced) for the rest of the process."""
    torch.set_num_threads(1)
    world = one_rank_world()
    next(world)
    with tempfile.TemporaryDirectory() as scratch:
        model = narrow_model(config, Path(scratch) / config)
        batch = cached_batch(config, model, resolution)
        plain = measure(plain_step(config, model, variant, batch), steps)
        for preset in presets:
            stk = measure(stk_step(config, model, variant, preset, batch), steps)
            print(json.dumps(row(config, variant, preset, stk, plain)), flush=True)
    next(world, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the counted one (median)")
    parser.add_argument("--resolution", type=int, default=256, help="px; the op count does not depend on it")
    parser.add_argument("--record", action="store_true", help="put the table into bench/RESULTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    presets = args.presets.split(",")
    if args.child:
        measure_variant(args.configs, args.variants, presets, args.steps, args.resolution)
        return
    rows = []
    for config in args.configs.split(","):
        for variant in args.variants.split(","):
            child = [
                sys.executable,
                __file__,
                "--child",
                "--configs",
                config,
                "--variants",
                variant,
                "--presets",
                args.presets,
                "--steps",
                str(args.steps),
                "--resolution",
                str(args.resolution),
            ]
            out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
                    rows.append(json.loads(line))
    table = markdown(rows, "python bench/overhead.py " + " ".join(sys.argv[1:]))
    print(table)
    if args.record:
        record(table)


if __name__ == "__main__":
    main()
