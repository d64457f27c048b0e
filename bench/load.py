"""Benchmark the host memory of loading the denoiser: stk-train's loader against diffusers' from_pretrained.

    python bench/load.py [--double 2 --single 2] [--workdir DIR]

A Flux-architecture transformer at full width (3072 hidden, 24 heads) with --double double and --single single
blocks (2 + 2: 1.03B parameters), random weights, written with save_pretrained twice: in bf16 (as Flux.1-dev ships)
and in fp32 (as SDXL's UNet ships). Each load runs in a fresh process and reports its RSS high-water mark (VmHWM)
above the RSS it had before loading (interpreter, torch, diffusers and DeepSpeed imported; under ZeRO-3 also the
process group and DeepSpeed's communication buffers, warmed by one tiny partitioned layer), as a multiple of the
model's bf16 size:

  * diffusers' FluxTransformer2DModel.from_pretrained(torch_dtype=bfloat16), the baseline;
  * stk's loader (Objective.load_denoiser(bfloat16), what every rank runs without ZeRO-3). Target <= 1.3x;
  * under ZeRO-3 with 2 ranks (mpiexec), the same call with the run's zero3 config: each rank's peak while the
    model is built, before any optimizer exists. Target <= 0.6x.

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
from pathlib import Path

TARGETS = {"stk": 1.3, "zero3": 0.6}
PYTHON = sys.executable
MPIEXEC = str(Path(PYTHON).parent / "mpiexec")

# One load in a fresh process: prints {"rank", "before", "peak"} in MiB. argv: how, folder, model root.
LOAD = """
import json, os, sys
how, root = sys.argv[1], sys.argv[2]

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}

import torch, deepspeed
from diffusers import FluxTransformer2DModel
from stk.models import Family
from stk.train.objectives import objective_for
from stk.world import get_world

world, zero3 = get_world(), None
if how == "zero3":
    from stk.train.distributed import init_distributed, resolve_dist_env
    from stk.train.dsconfig import load_deepspeed_config
    from stk.train.engine import engine_config
    from stk.train.options import TrainOptions

    init_distributed(resolve_dist_env(world, os.environ), backend="gloo")
    zero3 = engine_config(TrainOptions(model=root, output_dir=root), load_deepspeed_config("zero3"), "bf16")
    with deepspeed.zero.Init(config_dict_or_path=zero3, mem_efficient_linear=False):  # DeepSpeed's own start-up:
        warm = torch.nn.Linear(64, 64)  # its communication buffers are not the model's
    with deepspeed.zero.GatheredParameters(list(warm.parameters()), modifier_rank=0):
        pass
before = status()["VmRSS"]
if how == "diffusers":
    model = FluxTransformer2DModel.from_pretrained(root, subfolder="transformer", torch_dtype=torch.bfloat16)
else:
    model = objective_for(Family.FLUX, root).load_denoiser(torch.bfloat16, world, zero3)
with torch.no_grad():  # every weight read once, as training will
    total = sum(float(getattr(p, "ds_tensor", p).float().sum()) for p in model.parameters())
print(json.dumps({"rank": world.rank, "before": before, "peak": status()["VmHWM"]}), flush=True)
"""


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    out.update(OMP_NUM_THREADS="2", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return out


def build(root: Path, double: int, single: int) -> dict[str, Path]:
    """The model saved in bf16 and in fp32 as two pipeline folders (only the transformer and model_index.json)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    folders = {"bf16": root / "flux-bf16", "fp32": root / "flux-fp32"}
    if all((f / "transformer" / "config.json").is_file() for f in folders.values()):
        return folders
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        num_layers=double, num_single_layers=single, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, guidance_embeds=True,
    )  # fmt: skip
    for dtype, folder in folders.items():
        model.to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])).save_pretrained(folder / "transformer")
        FlowMatchEulerDiscreteScheduler().save_pretrained(folder / "scheduler")  # read by stk's Flux objective
        index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
        (folder / "model_index.json").write_text(json.dumps(index))
    return folders


def measure(how: str, folder: Path, workdir: Path) -> list[dict[str, int]]:
    script = workdir / "load_once.py"
    script.write_text(LOAD)
    command = [PYTHON, str(script), how, str(folder)]
    if how == "zero3":
        command = [MPIEXEC, "-n", "2", *command]
    proc = subprocess.run(command, capture_output=True, text=True, env=env())
    if proc.returncode != 0:
        raise SystemExit(f"{how} on {folder} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--double", type=int, default=2, help="double-stream blocks")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "stk-bench-load")
    parser.add_argument("--loaders", default="diffusers,stk,zero3", help="comma list of diffusers, stk, zero3")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    folders = build(args.workdir / f"d{args.double}-s{args.single}", args.double, args.single)
    bf16_mib = (folders["bf16"] / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size / 2**20
    print(f"# bench/load.py on {platform.node()}: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    blocks = f"{args.double} double + {args.single} single blocks"
    print(f"model: Flux architecture, {blocks}, bf16 size {bf16_mib:,.0f} MiB")
    print(f"\n{'file':<6}{'loader':<26}{'rank':>5}{'before MiB':>12}{'peak MiB':>10}{'added':>9}{'x bf16':>8}  target")
    for dtype in ("bf16", "fp32"):
        loaders = (("diffusers", "diffusers from_pretrained"), ("stk", "stk"), ("zero3", "stk, ZeRO-3, 2 ranks"))
        for how, label in (loader for loader in loaders if loader[0] in args.loaders.split(",")):
            for row in measure(how, folders[dtype], args.workdir):
                added = row["peak"] - row["before"]
                ratio = added / bf16_mib
                target = TARGETS.get(how)
                verdict = "" if target is None else f"<= {target}x {'PASS' if ratio <= target else 'FAIL'}"
                print(f"{dtype:<6}{label:<26}{row['rank']:>5}{row['before']:>12,}{row['peak']:>10,}{added:>9,}"
                      f"{ratio:>8.2f}  {verdict}")  # fmt: skip
    print("\nadded: the RSS high-water mark above the process's RSS before loading, every weight read once after")


if __name__ == "__main__":
    main()
