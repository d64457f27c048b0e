"""Benchmark stk-train's data path against the step it feeds, and against today's loader.

    python bench/train.py [--images 256] [--steps 60] [--batch-size 4] [--ranks 2] [--workdir DIR]

One run, on a generated dataset cached by stk-cache with a tiny random-weight SDXL model (CPU):

  * stk-train for --steps steps under mpiexec: the fraction of step time spent waiting for data
    (metrics.jsonl: sum of data_wait over sum of step_time, first step excluded: it includes
    start-up). Target < 1%.
  * the step's appetite: samples per second one rank consumes (batch size / median step time).
  * the same run with --no-check-shards, side by side: what checking each shard's sha256 before
    its first sample is used costs in data wait (target: a change under 1% of step time), and
    sha256 throughput on the cache's own shard files, to scale the cost to 512 MiB shards.
  * what TensorBoard (MetricsLog with --report-to tensorboard against none: the same rows, written and flushed)
    and the EMA (ShardedEma.update on the model's denoiser, one rank's share of 2) add to a step, as a share of
    stk-train's median step; and the EMA's memory per rank, sharded over 2 ranks against a full fp32 copy.
    Targets: each < 1% of step time.
  * sample images: a round of --prompts prompts (30 inference steps) in stk-train on --ranks ranks, each making
    its share, against the same round on one rank (what trainers that sample on the main process alone take,
    while the other ranks wait): seconds per round, per image, and the ratio. Reported, no target.
  * stk's loader alone (CacheData + BatchLoader, the same sampler batches, no training) against
    today's loader: one torch.save file per latent and per text embedding through gzip level 9,
    read by a torch DataLoader with the same number of worker processes as stk's threads. Target:
    stk's loader >= 5x what the step consumes.

The script always exits 0: it is a report, and a missed target is printed as FAIL.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model
from stk.shards.layout import file_sha256
from stk.train.data.loader import BatchLoader, CacheData
from stk.train.data.sampler import BucketSampler
from stk.train.report.metrics import MetricsLog

TARGETS = {"wait_fraction": 0.01, "loader_vs_step": 5.0, "check_wait_change": 0.01, "tensorboard": 0.01, "ema": 0.01}
PYTHON = sys.executable
MPIEXEC = str(Path(PYTHON).parent / "mpiexec")


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("STK_", "SLURM_", "PMI_"))}
    out.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return out


def run(command: list[str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, env=env())
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def prepare(workdir: Path, images: int) -> tuple[str, Path, Path]:
    """A dataset, its scan, a tiny SDXL model and its float16 cache in 1 MiB shards (reused when present)."""
    model, scan, cache = workdir / "model", workdir / "scan", workdir / "cache"
    if (cache / "manifest.json").exists():
        return str(model), scan, cache
    generate_dataset(str(workdir / "images"), count=images, seed=1, min_side=64, max_side=80)
    build_tiny_model(Family.SDXL, str(model))
    run(
        [
            PYTHON,
            "-m",
            "stk.cli.scan",
            str(workdir / "images"),
            "--out",
            str(scan),
            "--resolution",
            "64",
            "--alignment",
            "64",
            "--allow-oversubscription",
            "-q",
        ]
    )
    # 1 MiB shards: several, so that first reads of new shards (and their checksums) fall inside the measured steps
    run(
        [
            PYTHON,
            "-m",
            "stk.cli.cache",
            str(scan),
            "--model",
            str(model),
            "--out",
            str(cache),
            "--shard-size",
            "1",
            "-q",
        ]
    )
    return str(model), scan, cache


def train(
    model: str, scan: Path, cache: Path, out: Path, steps: int, batch: int, ranks: int, threads: int, *extra: str
) -> dict:
    command = [
        MPIEXEC,
        "-n",
        str(ranks),
        PYTHON,
        "-m",
        "stk.cli.train",
        "--cache",
        str(cache),
        "--scan",
        str(scan),
        "--model",
        model,
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--epochs",
        "1000",
        "--batch-size",
        str(batch),
        "--deepspeed",
        "zero2",
        "--checkpoint-every",
        "0",
        "--resume",
        "none",
        "--loader-threads",
        str(threads),
        "--allow-oversubscription",
        "-q",
        *extra,
    ]
    summary: dict[str, Any] = json.loads(run(command))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][1:]  # training steps (a round at step 0 is a row of its own)
    waited, stepped = sum(r["data_wait"] for r in rows), sum(r["step_time"] for r in rows)
    step = statistics.median(r["step_time"] for r in rows)
    rounds = [r["sample_seconds"] for r in rows if "sample_seconds" in r]
    return {
        "summary": summary,
        "wait_fraction": waited / stepped,
        "median_step_s": step,
        "per_rank_rate": batch / step,
        "sample_round_s": statistics.median(rounds) if rounds else None,
    }


def sha256_rate(cache: Path) -> float:
    """MB/s of stk's shard checksum over the cache's shard files (read from the page cache)."""
    shards = sorted((cache / "shards").iterdir())
    started = time.perf_counter()
    for shard in shards:
        file_sha256(str(shard))
    return sum(s.stat().st_size for s in shards) / 1e6 / (time.perf_counter() - started)


def tensorboard_cost(workdir: Path, rows: int = 300) -> float:
    """Seconds per step that TensorBoard adds to metrics.jsonl: the same rows through MetricsLog, with and without."""
    seconds = {}
    for report_to in ("none", "tensorboard"):
        out = workdir / f"report-{report_to}"
        out.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(str(out), True, report_to)
        log.start(0)
        started = time.perf_counter()
        for step in range(1, rows + 1):
            log.write(
                {
                    "step": step,
                    "epoch": step / rows,
                    "loss": 1 / step,
                    "lr": 1e-4,
                    "grad_norm": 0.5,
                    "samples_per_s": 20.0,
                    "step_time": 0.2,
                    "data_wait": 1e-4,
                    "time": time.time(),
                }
            )
        seconds[report_to] = (time.perf_counter() - started) / rows
        log.close()
    return seconds["tensorboard"] - seconds["none"]


def ema_cost(model: str, updates: int = 50) -> tuple[float, int, int]:
    """Seconds per update of one rank's EMA share (2 ranks) of the denoiser, that share's bytes, and a full fp32
    copy's bytes (what an EMA model on every rank holds)."""
    from stk.train.objective.objectives import objective_for
    from stk.train.trainable.ema import ShardedEma

    denoiser = objective_for(Family.SDXL, model).load_denoiser(torch.float32)
    ema = ShardedEma(denoiser, decay=0.999, every=1, rank=0, world=2)
    ema.update(1)
    started = time.perf_counter()
    for step in range(2, updates + 2):
        ema.update(step)
    return (time.perf_counter() - started) / updates, ema.shadow.numel() * 4, ema.total * 4


def stk_loader_rate(cache: Path, batch: int, threads: int, batches: int) -> float:
    with CacheData(str(cache)) as data:
        sampler = BucketSampler(data.buckets(), 1, batch, 1, 0, seed=0, drop_last=False)
        order = [keys for _, keys in zip(range(batches), _cycle(sampler), strict=False)]
        started = time.perf_counter()
        loader = BatchLoader(data, order, threads=threads, prefetch=2 * threads)
        count = sum(len(b) for b in loader)
        loader.close()
        return count / (time.perf_counter() - started)


def _cycle(sampler: BucketSampler):  # type: ignore[no-untyped-def]
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from sampler
        epoch += 1


class GzipFiles(Dataset):
    """Today's layout: <key>.latent.pt.gz and <key>.text.pt.gz, one torch.save each."""

    def __init__(self, root: Path, keys: list[str]) -> None:
        self.root, self.keys = root, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with gzip.open(self.root / f"{self.keys[i]}.latent.pt.gz", "rb") as f:
            latent = torch.load(f)
        with gzip.open(self.root / f"{self.keys[i]}.text.pt.gz", "rb") as f:
            text = torch.load(f)
        return latent.float(), text["prompt_embeds"].float(), text["pooled_prompt_embeds"].float()


def write_gzip_files(cache: Path, root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    with CacheData(str(cache)) as data:
        keys = [k for ks in data.buckets().values() for k in ks]
        for key in keys:
            sample = data.reader.latent(key)
            text = data.reader.text(sample.text_key)
            for name, obj in (
                ("latent", torch.from_numpy(sample.mean)),
                ("text", {k: torch.from_numpy(v) for k, v in text.arrays.items()}),
            ):
                with gzip.open(root / f"{key}.{name}.pt.gz", "wb", compresslevel=9) as f:
                    torch.save(obj, f)
    return keys


def gzip_loader_rate(root: Path, keys: list[str], batch: int, workers: int, batches: int) -> float:
    loader = DataLoader(
        GzipFiles(root, keys),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        prefetch_factor=2,
        persistent_workers=False,
    )
    started, count = time.perf_counter(), 0
    while count < batches * batch:
        for latents, _, _ in loader:
            count += len(latents)
            if count >= batches * batch:
                break
    return count / (time.perf_counter() - started)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="stk loader threads = baseline DataLoader workers")
    parser.add_argument("--prompts", type=int, default=4, help="sample prompts per round")
    parser.add_argument("--workdir", default=None, help="keep the dataset, model and cache here between runs")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="stk-bench-train-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, scan, cache = prepare(workdir, args.images)

    print(
        f"# bench/train.py on {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"dataset: {args.images} images, tiny SDXL, batch {args.batch_size} x {args.ranks} ranks, {args.steps} steps")
    trained = train(model, scan, cache, workdir / "run", args.steps, args.batch_size, args.ranks, args.threads)
    wait = trained["wait_fraction"]
    print(
        f"stk-train: median step {trained['median_step_s'] * 1000:.1f} ms, a rank consumes "
        f"{trained['per_rank_rate']:.1f} samples/s; waiting for data {wait * 100:.4f}% of step time "
        f"(target < {TARGETS['wait_fraction'] * 100:.0f}%): {verdict(wait < TARGETS['wait_fraction'])}"
    )

    unchecked = train(
        model,
        scan,
        cache,
        workdir / "run-unchecked",
        args.steps,
        args.batch_size,
        args.ranks,
        args.threads,
        "--no-check-shards",
    )
    change = wait - unchecked["wait_fraction"]
    ok = abs(change) < TARGETS["check_wait_change"]
    ratio = wait / unchecked["wait_fraction"] if unchecked["wait_fraction"] else float("inf")
    print(
        f"shard check: waiting for data {wait * 100:.4f}% of step time checked, "
        f"{unchecked['wait_fraction'] * 100:.4f}% with --no-check-shards (median step "
        f"{unchecked['median_step_s'] * 1000:.1f} ms): ratio {ratio:.2f}, change {change * 100:+.4f}% of step time "
        f"(target < {TARGETS['check_wait_change'] * 100:.0f}%): {verdict(ok)}"
    )
    rate = sha256_rate(cache)
    print(
        f"sha256 of the shard files: {rate:.0f} MB/s on one core; a 512 MiB shard: {512 * 2**20 / 1e6 / rate:.2f} s, "
        "once per shard per rank, on a loader or prefetch thread"
    )

    step = trained["median_step_s"]
    board = tensorboard_cost(workdir)
    print(
        f"TensorBoard: {board * 1e6:.0f} us per step, {board / step * 100:.3f}% of the median step (target < "
        f"{TARGETS['tensorboard'] * 100:.0f}%): {verdict(board / step < TARGETS['tensorboard'])}"
    )
    update, share, full = ema_cost(model)
    print(
        f"EMA: {update * 1e6:.0f} us per update of one rank's share, {update / step * 100:.3f}% of the median step "
        f"(target < {TARGETS['ema'] * 100:.0f}%): {verdict(update / step < TARGETS['ema'])}; memory per rank "
        f"{share / 2**20:.2f} MiB sharded over 2 ranks against {full / 2**20:.2f} MiB for a full fp32 copy "
        f"({share / full:.3f}x)"
    )

    prompts = [arg for k in range(args.prompts) for arg in ("--validation-prompt", f"prompt number {k}")]
    sampling = [*prompts, "--validation-every", "10", "--validation-steps", "30"]
    rounds = {
        ranks: train(
            model, scan, cache, workdir / f"samples-{ranks}", 20, args.batch_size, ranks, args.threads, *sampling
        )["sample_round_s"]
        for ranks in (args.ranks, 1)
    }
    split, alone = rounds[args.ranks], rounds[1]
    per_image = split * args.ranks / args.prompts
    print(
        f"samples: a round of {args.prompts} prompts at 64x64, 30 inference steps: {split:.2f} s on {args.ranks} "
        f"ranks ({per_image:.3f} s per image per rank), {alone:.2f} s on 1 rank as main-process sampling takes: "
        f"ratio {alone / split:.2f}x; every 500 steps of this model's step it is "
        f"{split / (500 * step) * 100:.2f}% of training time"
    )

    batches = 200
    stk_rate = stk_loader_rate(cache, args.batch_size, args.threads, batches)
    keys = write_gzip_files(cache, workdir / "gzip")
    base_rate = gzip_loader_rate(workdir / "gzip", keys, args.batch_size, args.threads, batches)
    appetite = stk_rate / trained["per_rank_rate"]
    print(
        f"loaders ({batches} batches of {args.batch_size}, {args.threads} threads/workers): "
        f"stk {stk_rate:.0f} samples/s, torch.save+gzip DataLoader {base_rate:.0f} samples/s: "
        f"ratio {stk_rate / base_rate:.2f}x"
    )
    print(
        f"stk loader vs what one rank's step consumes: {appetite:.1f}x (target >= "
        f"{TARGETS['loader_vs_step']:.0f}x): {verdict(appetite >= TARGETS['loader_vs_step'])}"
    )


if __name__ == "__main__":
    main()
