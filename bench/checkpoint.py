"""Benchmark what verifying a checkpoint costs against what loading it costs: stk's sha256 of every file of a
DeepSpeed checkpoint, side by side with DeepSpeed's own load_checkpoint of the same checkpoint, and the hashing a
save adds against the save itself.

    python bench/checkpoint.py [--params 50] [--repeat 3] [--workdir DIR]

One process, DeepSpeed on the CPU (gloo, a world of one), ZeRO-2, fp32 AdamW: a stack of linear layers with
--params million parameters (the checkpoint: 4 bytes a parameter of model states, 12 of optimizer states). The
checkpoint is saved through stk's CheckpointDir.save (which hashes each file right after writing it), then, each
--repeat times:

  * verify: CheckpointDir.resolve("auto") as a resume runs it (reads and hashes every file, before any model loads);
  * load: engine.load_checkpoint (parameters, optimizer and schedule), what every resume does after it.

Both read the files just written, from the page cache (dropping it would slow every other process on the machine);
from a cold disk or NFS both pay the same read once more. The target: verify <= load. The script exits 0 either
way: a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def build_engine(params_m: int):  # type: ignore[no-untyped-def]
    import deepspeed
    import torch

    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    loss = engine(torch.randn(1, width)).square().mean()  # one step: Adam's moments exist
    engine.backward(loss)
    engine.step()
    return engine, sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50, help="millions of parameters")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    from stk.cluster.slurm import free_port
    from stk.cluster.world import World
    from stk.train.checkpoint.digests import hash_files, listed_files
    from stk.train.checkpoint.store import CheckpointDir

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    engine, params = build_engine(args.params)
    work = args.workdir or tempfile.mkdtemp(prefix="stk-bench-checkpoint-")
    checkpoints = CheckpointDir(work, keep=2, rank=0)

    started = time.perf_counter()
    tag = checkpoints.save(engine, 1, {"stk": {"step": 1}}, {"seed": 0})
    save_s = time.perf_counter() - started
    folder = os.path.join(checkpoints.path, tag)
    files = listed_files(folder, skip=["stk-run.json"])
    size = sum(os.path.getsize(f) for f in files)
    started = time.perf_counter()
    hash_files(folder, files, 0)
    hash_s = time.perf_counter() - started

    verify, load = [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        resume = checkpoints.resolve("auto", World())
        verify.append(time.perf_counter() - started)
        assert resume is not None and resume.tag == tag
        started = time.perf_counter()
        engine.load_checkpoint(resume.directory, tag=resume.tag, load_optimizer_states=True)
        load.append(time.perf_counter() - started)

    print(f"machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}")
    print(
        f"software: torch {torch.__version__}, deepspeed {deepspeed.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"checkpoint: {params / 1e6:.1f}M parameters, ZeRO-2 fp32 AdamW, {len(files)} files, {size / 2**20:.0f} MiB")
    print(
        f"save (CheckpointDir.save, hashing included): {save_s:.2f} s; of which hashing: {hash_s:.2f} s "
        f"({hash_s / save_s:.0%}), {size / 2**20 / hash_s:.0f} MiB/s"
    )
    best_verify, best_load = min(verify), min(load)
    print(f"verify (resolve auto), s: {', '.join(f'{t:.2f}' for t in verify)}; best {best_verify:.2f}")
    print(f"load (engine.load_checkpoint), s: {', '.join(f'{t:.2f}' for t in load)}; best {best_load:.2f}")
    ratio = best_verify / best_load
    print(f"verify / load: {ratio:.2f} ({'ok' if ratio <= 1 else 'FAIL'}: target <= 1)")
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
