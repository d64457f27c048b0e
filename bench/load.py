"""Benchmark the host memory of loading the denoiser: stk-train's loader against diffusers' from_pretrained.

    python bench/load.py [--arch flux1|flux2] [--double 2 --single 2] [--workdir DIR]

A transformer of the chosen architecture at full width with --double double and --single single blocks, random
weights, written with save_pretrained:

  * flux1: FLUX.1's (3072 hidden, 24 heads; 2 + 2 blocks: 1.03B parameters), in bf16 (as FLUX.1-dev ships) and in
    fp32 (as SDXL's UNet ships);
  * flux2: FLUX.2-dev's published config (stk/models/configs/flux2-dev: Flux2Transformer2DModel, 6144 hidden = 48
    heads x 128, mlp ratio 3, joint_attention_dim 15360, 128 input channels; 1 + 1 blocks: 2.29B parameters), in
    bf16 only, as FLUX.2-dev ships (an fp32 copy would not fit beside diffusers' load on a 24 GiB machine).

Each load runs in a fresh process and reports its RSS high-water mark (VmHWM) above the RSS it had before loading
(interpreter, torch, diffusers and DeepSpeed imported; under ZeRO-3 also the process group and DeepSpeed's
communication buffers, warmed by one tiny partitioned layer), as a multiple of the model's bf16 size:

  * diffusers' from_pretrained(torch_dtype=bfloat16), the baseline;
  * stk's loader (Objective.load_denoiser(bfloat16), what every rank runs without ZeRO-3). Target <= 1.3x;
  * under ZeRO-3 with 2 ranks (mpiexec), the same call with the run's zero3 config: each rank's peak while the
    model is built, before any optimizer exists. Target <= 0.6x. "beyond shard" is that peak less the rank's own
    partition of the weights (which a GPU holds in its own memory, not the host's).

Weights touched after loading count: each process reads every weight once after the load (as training will), so
a loader that maps the file and leaves it untouched is charged for it too. The script always exits 0: a missed
target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stk.models.published import published_config

TARGETS = {"stk": 1.3, "zero3": 0.6}
PYTHON = sys.executable
MPIEXEC = str(Path(PYTHON).parent / "mpiexec")

# One load in a fresh process: prints {"rank", "before", "peak", "held"} in MiB (held: this rank's partition of the
# weights under ZeRO-3, else 0). argv: how, model root, family.
LOAD = """
import json, os, sys
how, root, family = sys.argv[1:4]

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}

import torch, deepspeed
from stk.models.families import Family, spec_for
from stk.train.objective.objectives import objective_for
from stk.cluster.world import get_world

world, zero3 = get_world(), None
if how == "zero3":
    from stk.train.deepspeed.distributed import init_distributed, resolve_dist_env
    from stk.train.deepspeed.config import load_deepspeed_config
    from stk.train.deepspeed.engine import engine_config
    from stk.train.options import TrainOptions

    init_distributed(resolve_dist_env(world, os.environ), backend="gloo")
    zero3 = engine_config(TrainOptions(model=root, output_dir=root), load_deepspeed_config("zero3"), "bf16")
    with deepspeed.zero.Init(config_dict_or_path=zero3, mem_efficient_linear=False):  # DeepSpeed's own start-up:
        warm = torch.nn.Linear(64, 64)  # its communication buffers are not the model's
    with deepspeed.zero.GatheredParameters(list(warm.parameters()), modifier_rank=0):
        pass
before = status()["VmRSS"]
if how == "diffusers":
    model = spec_for(Family(family)).denoiser.model_class.from_pretrained(
        root, subfolder="transformer", torch_dtype=torch.bfloat16
    )
else:
    model = objective_for(Family(family), root).load_denoiser(torch.bfloat16, world, zero3)
with torch.no_grad():  # every weight read once, as training will
    total = sum(float(getattr(p, "ds_tensor", p).float().sum()) for p in model.parameters())
held = sum(p.ds_tensor.nbytes for p in model.parameters() if hasattr(p, "ds_tensor")) // 2**20
print(json.dumps({"rank": world.rank, "before": before, "peak": status()["VmHWM"], "held": held}), flush=True)
"""


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    out.update(OMP_NUM_THREADS="2", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return out


@dataclass(frozen=True)
class Arch:
    """A transformer to measure: its stk family, its config at full width (blocks set by --double and --single), the
    pipeline class its model_index.json names, and the file dtypes it is written in."""

    family: str
    config: dict[str, Any]
    pipeline: str
    dtypes: tuple[str, ...]
    blocks: tuple[int, int]  # double and single blocks by default


FLUX1 = dict(
    _class_name="FluxTransformer2DModel",
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    in_channels=64,
    guidance_embeds=True,
)
# FLUX.2-dev's published config (stk/models/configs/flux2-dev), blocks set by --double and --single
FLUX2_DEV = published_config("flux2-dev", "denoiser")
ARCHS = {
    "flux1": Arch("flux", FLUX1, "FluxPipeline", ("bf16", "fp32"), (2, 2)),
    "flux2": Arch("flux2", FLUX2_DEV, "Flux2Pipeline", ("bf16",), (1, 1)),
}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def build(root: Path, arch: Arch, double: int, single: int, **overrides: Any) -> dict[str, Path]:
    """The model saved in each of the arch's dtypes as pipeline folders (only the transformer, the scheduler and
    model_index.json). Its weights are drawn in the widest of those dtypes, so that a bf16-only model never exists in
    fp32 (FLUX.2-dev's 2.29B parameters would take 9 GiB)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from stk.models.published import build_published

    folders = {dtype: root / f"{arch.family}-{dtype}" for dtype in arch.dtypes}
    if all((f / "transformer" / "config.json").is_file() for f in folders.values()):
        return folders
    torch.manual_seed(0)
    widest = torch.float32 if "fp32" in arch.dtypes else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(widest)
    try:
        config = {**arch.config, "num_layers": double, "num_single_layers": single, **overrides}
        model = build_published(config, "cpu")
    finally:
        torch.set_default_dtype(default)
    for dtype, folder in folders.items():
        model.to(getattr(torch, DTYPES[dtype])).save_pretrained(folder / "transformer")
        FlowMatchEulerDiscreteScheduler().save_pretrained(folder / "scheduler")  # read by stk's flow objectives
        index = {"_class_name": arch.pipeline, "transformer": ["diffusers", arch.config["_class_name"]]}
        (folder / "model_index.json").write_text(json.dumps(index))
    return folders


def measure(how: str, folder: Path, workdir: Path, family: str) -> list[dict[str, int]]:
    """One load (`how`: diffusers, stk or zero3) of the model in `folder`: each rank's row, in MiB."""
    script = workdir / "load_once.py"
    script.write_text(LOAD)
    command = [PYTHON, str(script), how, str(folder), family]
    if how == "zero3":
        command = [MPIEXEC, "-n", "2", *command]
    proc = subprocess.run(command, capture_output=True, text=True, env=env())
    if proc.returncode != 0:
        raise SystemExit(f"{how} on {folder} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def bf16_mib(folder: Path) -> float:
    """The size of the bf16 model's weights file."""
    return (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="flux1", help="the transformer's architecture")
    parser.add_argument("--double", type=int, help="double-stream blocks (flux1: 2, flux2: 1)")
    parser.add_argument("--single", type=int, help="single-stream blocks (flux1: 2, flux2: 1)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "stk-bench-load")
    parser.add_argument("--loaders", default="diffusers,stk,zero3", help="comma list of diffusers, stk, zero3")
    args = parser.parse_args()
    arch = ARCHS[args.arch]
    double = arch.blocks[0] if args.double is None else args.double
    single = arch.blocks[1] if args.single is None else args.single
    args.workdir.mkdir(parents=True, exist_ok=True)
    folders = build(args.workdir / f"{args.arch}-d{double}-s{single}", arch, double, single)
    size = bf16_mib(folders["bf16"])
    print(f"# bench/load.py on {platform.node()}: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print(f"model: {arch.config['_class_name']}, {double} double + {single} single blocks, bf16 size {size:,.0f} MiB")
    print(
        f"\n{'file':<6}{'loader':<26}{'rank':>5}{'before MiB':>12}{'peak MiB':>10}{'added':>9}{'x bf16':>8}"
        f"{'beyond shard':>14}  target"
    )
    loaders = (("diffusers", "diffusers from_pretrained"), ("stk", "stk"), ("zero3", "stk, ZeRO-3, 2 ranks"))
    for dtype, folder in folders.items():
        for how, label in (loader for loader in loaders if loader[0] in args.loaders.split(",")):
            for row in measure(how, folder, args.workdir, arch.family):
                added = row["peak"] - row["before"]
                ratio = added / size
                beyond = f"{(added - row['held']) / size:.2f}" if how == "zero3" else ""
                target = TARGETS.get(how)
                verdict = "" if target is None else f"<= {target}x {'PASS' if ratio <= target else 'FAIL'}"
                print(
                    f"{dtype:<6}{label:<26}{row['rank']:>5}{row['before']:>12,}{row['peak']:>10,}{added:>9,}"
                    f"{ratio:>8.2f}{beyond:>14}  {verdict}"
                )
    print("\nadded: the RSS high-water mark above the process's RSS before loading, every weight read once after;")
    print("beyond shard: added less the rank's own partition of the weights, x bf16")


if __name__ == "__main__":
    main()
