"""`make demo`: the main job on a built-in default, so a new user sees stk work in a minute.

Generates a small mixed dataset (every format stk reads, rotated photos, captions, a broken file,
a damaged EXIF block, formats stk does not train on), a second, small style dataset with settings of its own
(resolution, repeats, a random crop, caption dropout, a weight; `datasets.toml`) and
a tiny random-weight model of the family (`--family`, SDXL by default), then runs the pipeline with 2 MPI ranks
exactly as a cluster job would: stk-scan, stk-cache (with two validation prompts), then stk-train (DeepSpeed ZeRO-2
on the CPU), every weight with an EMA and then a LoRA (ZeRO-3), each making sample images of the prompts along the
way and logging to TensorBoard; diffusers' load_lora_weights loads the LoRA at the end.

Between the two, what a lost node and a damaged disk do to a run: the newest checkpoint of the full run is
damaged on purpose, and the run is continued on one rank, as a job requeued on the nodes left would: stk-train
finds the damage, resumes from the checkpoint before it, keeps the effective batch by accumulating over two
micro-steps, and trains on to a few steps past the first run's end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any, NamedTuple

import click

import stk.cli  # noqa: F401  (first: silences the model libraries' import-time notices, as for every command)
from stk.datagen import generate_dataset, generate_format_samples
from stk.models import Family, build_tiny_model, quiet_model_libraries
from stk.models.families import DEMO_FAMILY, family_names

CHECKPOINT_EVERY = 10  # the full run's --checkpoint-every
# The damaged newest checkpoint needs one before it: one at CHECKPOINT_EVERY, and one at the last step after it.
MIN_STEPS = CHECKPOINT_EVERY + 1


def _enough_steps(ctx: click.Context, param: click.Parameter, steps: int) -> int:
    """--steps, refused before any work where the run would leave one checkpoint to resume from."""
    if steps < MIN_STEPS:
        raise click.BadParameter(
            f"{steps} is too few: the demo damages the newest checkpoint and resumes from the one before, so it needs "
            f"two (every {CHECKPOINT_EVERY} steps and the last): give at least {MIN_STEPS}"
        )
    return steps


def _mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec") or "mpiexec"


def _run(ranks: int, module: str, args: list[str]) -> dict[str, Any]:
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", module, *args]
    click.echo("$ " + " ".join(command), err=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(result.returncode)
    summary: dict[str, Any] = json.loads(result.stdout)
    return summary


class _Paths(NamedTuple):
    """Where each step's inputs and outputs go, under --dir."""

    workdir: str
    data: str
    scan: str
    cache: str
    run: str  # every weight, with an EMA
    lora: str

    @classmethod
    def under(cls, workdir: str) -> _Paths:
        return cls(workdir, *(os.path.join(workdir, n) for n in ("images", "scan", "cache", "run", "lora")))


class _Runs(NamedTuple):
    """The summaries of stk-train's three runs, and the checkpoint file damaged between the first two."""

    trained: dict[str, Any]
    damaged: str
    continued: dict[str, Any]
    adapted: dict[str, Any]


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--dir", "workdir", default="demo-output", help="Where the dataset, model and outputs go (replaced).")
@click.option("--images", default=96, help="Images to generate.")
@click.option("--ranks", default=2, help="MPI ranks for each step.")
@click.option("--steps", default=20, callback=_enough_steps, help=f"Training steps (at least {MIN_STEPS}).")
@click.option(
    "--family",
    type=click.Choice(family_names()),
    default=DEMO_FAMILY.value,
    help="The model family of the tiny model trained.",
)
def main(workdir: str, images: int, ranks: int, steps: int, family: str) -> None:
    """Generate a dataset and a tiny model, then scan, cache and train with MPI ranks."""
    shutil.rmtree(workdir, ignore_errors=True)
    paths = _Paths.under(workdir)
    model = _generate(paths, images, family)
    datasets = _datasets(workdir, paths.data, images)
    scan_options = ["--resolution", "64", "--alignment", "16", "--batch-size", "2", "--max-errors", "5"]
    scan_options += ["--gpus", str(ranks)]  # the training below runs on this many ranks
    scan_options += ["--allow-oversubscription"]  # small demo buckets: apply the repeats they need
    scanned = _run(ranks, "stk.cli.scan", ["--datasets", datasets, "--out", paths.scan, *scan_options])
    cache_options = ["--batch-size", "8", "--validation-prompts", _prompts(workdir)]
    cached = _run(ranks, "stk.cli.cache", [paths.scan, "--model", model, "--out", paths.cache, *cache_options])
    runs = _train(paths, model, ranks, steps)
    layers = _load_lora(model, runs.adapted["final"])
    _report(paths, ranks, datasets, scanned, cached, runs, layers)


def _generate(paths: _Paths, images: int, family: str) -> str:
    """The mixed dataset (a broken file among it) and the tiny model; returns the model's directory."""
    generate_dataset(paths.data, images)
    formats = generate_format_samples(os.path.join(paths.data, "formats"))  # AVIF, HEIC, JPEG XL, JPEG 2000, ...
    with open(os.path.join(paths.data, "broken.jpg"), "wb") as f:
        f.write(b"not really a jpeg")
    quiet_model_libraries()
    model = build_tiny_model(Family(family), os.path.join(paths.workdir, f"tiny-{family}"))
    click.echo(
        f"generated {images} images, {len(formats)} more in every other format (+1 broken file) in {paths.data} "
        f"and a tiny {family} model in {model}",
        err=True,
    )
    return model


def _prompts(workdir: str) -> str:
    """The validation prompts stk-cache embeds for the runs' sample images; returns the file."""
    prompts = os.path.join(workdir, "prompts.txt")
    with open(prompts, "w", encoding="utf-8") as f:
        f.write("a red square on a blue background\ntwo circles\n")
    return prompts


def _train(paths: _Paths, model: str, ranks: int, steps: int) -> _Runs:
    """Every weight with an EMA; its newest checkpoint damaged and the run continued on one rank; then a LoRA."""
    train = ["--cache", paths.cache, "--scan", paths.scan, "--model", model, "--batch-size", "2"]
    train += ["--max-steps", str(steps)]
    train += ["--validation-every", "10", "--validation-steps", "10"]  # samples of the cache's prompts
    full = [*train, "--output-dir", paths.run, "--deepspeed", "zero2", "--lr", "1e-4"]
    full += ["--checkpoint-every", str(CHECKPOINT_EVERY), "--ema-decay", "0.9"]
    trained = _run(ranks, "stk.cli.train", full)
    damaged = _damage(trained["checkpoint"])
    more = steps + 4
    full[full.index("--max-steps") + 1] = str(more)
    continued = _run(1, "stk.cli.train", full)  # a node lost: on the rank that is left, from the newest good one
    lora = [*train, "--output-dir", paths.lora, "--deepspeed", "zero3", "--lr", "1e-3"]
    adapted = _run(ranks, "stk.cli.train", [*lora, "--lora-rank", "8", "--caption-dropout", "0.1"])
    return _Runs(trained, damaged, continued, adapted)


def _report(
    paths: _Paths,
    ranks: int,
    datasets: str,
    scanned: dict[str, Any],
    cached: dict[str, Any],
    runs: _Runs,
    layers: int,
) -> None:
    """What each step did and where its outputs are."""
    scan, cache, run, lora = paths.scan, paths.cache, paths.run, paths.lora
    trained, continued, adapted = runs.trained, runs.continued, runs.adapted
    per_dataset = ", ".join(f"{d['name']} {d['images']}" for d in scanned["datasets"])
    click.echo(
        f"\nscan:  {scanned['files']} files on {scanned['ranks']} ranks: {scanned['images']} images ({per_dataset}) in "
        f"{scanned['buckets']} buckets, {scanned['errors']} error(s), {scanned['warnings']} warning(s) "
        f"-> {scan}/metadata.parquet; why: {scan}/errors.jsonl; the datasets: {datasets}\n"
        f"cache: {cached['encoded_images']} latents and {cached['encoded_captions']} caption embeddings in "
        f"{cached['shards_written']} shard(s) -> {cache}/manifest.json\n"
        f"train: {trained['steps']} steps on {ranks} ranks, last loss {trained['loss']:.4f}, "
        f"{trained['samples_per_second']:.1f} samples/s, samples by dataset (drawn by weight) "
        f"{trained['samples_per_dataset']} -> {run}/metrics.jsonl, {trained['checkpoint']}\n"
        f"again: {runs.damaged} damaged on purpose; on 1 rank, stk-train skipped that checkpoint and resumed from "
        f"{continued['resumed_from']} (the same effective batch: 2 micro-steps each) to step {continued['steps']}\n"
        f"final: {continued['final']} (a diffusers pipeline: DiffusionPipeline.from_pretrained; the EMA weights, "
        f"the raw ones in {run}/final-no-ema)\n"
        f"samples: {run}/samples/step-*/grid.png and {lora}/samples/ (the prompts at step 0, every 10 steps and "
        f"the end; the EMA and the LoRA in use)\n"
        f"curves: tensorboard --logdir {run}/tensorboard (losses, lr, the samples)\n"
        f"lora:  {adapted['steps']} steps, ZeRO-3, last loss {adapted['loss']:.4f} -> {adapted['final']}, "
        f"loaded into the pipeline with load_lora_weights: {layers} adapted layers\n"
        f"next:  stk-cache info {cache} | jq . ; jq -c '{{step, loss}}' {run}/metrics.jsonl",
        err=True,
    )


def _datasets(workdir: str, data: str, images: int) -> str:
    """Two datasets with their own settings: the mixed one, and a small style set at another resolution, cropped at
    random, repeated, half its samples without their caption, drawn once for every three of the other."""
    style = os.path.join(workdir, "style")
    generate_dataset(style, max(images // 4, 8), seed=7, min_side=96, max_side=160)
    listed = os.path.join(workdir, "datasets.toml")
    with open(listed, "w", encoding="utf-8") as f:
        f.write(
            f'[[dataset]]\nname = "mixed"\nsource = "{data}"\nweight = 3.0\n\n'
            f'[[dataset]]\nname = "style"\nsource = "{style}"\nresolution = 96\nrepeats = 4\ncrop = "random"\n'
            "caption-dropout = 0.5\nweight = 1.0\n"
        )
    return listed


def _damage(checkpoint: str) -> str:
    """Overwrite 64 bytes in the middle of the checkpoint's largest file, as a bad disk would; returns its path."""
    files = [os.path.join(root, name) for root, _, names in os.walk(checkpoint) for name in names]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        f.write(b"\xa5" * 64)
    return target


def _load_lora(model: str, lora_dir: str) -> int:
    """Load the trained LoRA into the source pipeline, as a user would; returns how many layers it adapts."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.load_lora_weights(lora_dir)
    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    return sum(name.endswith("lora_A") for name, _ in denoiser.named_modules())


if __name__ == "__main__":
    main()
