"""stk-train end to end, as users run it: real DeepSpeed engines on the CPU under `mpiexec -n 2`,
tiny random-weight SD, SDXL and Flux pipelines, caches made by stk-cache. Each run checks its exit
code, metrics.jsonl, checkpoints and the final diffusers model; other tests resume, signal, fault
and feed bad setups."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from diffusers import DiffusionPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from support.commands import FAST, MPIEXEC, TRAIN, clean_env, run_train, scan_env, summary_of, train_command, train_env
from support.gpu_readings import gpu
from support.processes import mpi_rank_pids
from support.tiny_batches import Recorder, step_inputs
from support.train_outputs import SAMPLING, board_images, metrics, sample_pngs, samples_match, wandb_history

from stk.cli.train import main as train_main
from stk.errors import ExitCode
from stk.models import Family
from stk.train.lora import LORA_WEIGHTS, LoraSettings, add_lora
from stk.train.objectives import objective_for

pytestmark = pytest.mark.integration

DENOISER = {Family.SD: "unet", Family.SDXL: "unet", Family.FLUX: "transformer"}


def check_samples(out: Path, steps: list[int], size: tuple[int, int] = (64, 64), board: bool = True) -> None:
    """A round of PNGs (one per prompt, in order, and a grid of 2 x 2 cells) after each of `steps`, and in
    TensorBoard (`board`); each round's time in metrics.jsonl."""
    assert sorted(p.name for p in (out / "samples").iterdir()) == [f"step-{s:08d}" for s in steps]
    for step in steps:
        pngs = sample_pngs(out, step)
        assert sorted(pngs) == ["0-a-red-square.png", "1-two-blue-circles.png", "2-x.png", "grid.png"]
        for name, png in pngs.items():
            image = Image.open(io.BytesIO(png))
            assert image.format == "PNG" and image.size == (size if name != "grid.png" else (2 * size[0], 2 * size[1]))
    assert [r["step"] for r in metrics(out) if "sample_seconds" in r] == steps
    if board:
        assert [s for s, _ in board_images(out / "tensorboard", "samples/grid")] == steps


def check_wandb(out: Path, steps: list[int]) -> None:
    """The samples, and an offline W&B log instead of TensorBoard: each step's loss as metrics.jsonl has it, the
    grid at each round's step, its image file beside the log."""
    check_samples(out, steps, board=False)
    assert not (out / "tensorboard").exists()
    history = wandb_history(out)
    losses = {row["_step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert losses == {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}
    grids = [row for row in history if "samples/grid/path" in row]
    assert [row["_step"] for row in grids] == steps
    files = next(out.glob("wandb/offline-run-*/files"))
    assert all((files / row["samples/grid/path"]).is_file() for row in grids)


def latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


def checkpoint_module(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The module's weights in a ZeRO-1/2 checkpoint (every rank holds them all; rank 0 saved them)."""
    states = out / "checkpoints" / f"step-{step:08d}" / "mp_rank_00_model_states.pt"
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


def denoiser_weights(model_dir: Path, family: Family) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / DENOISER[family] / "diffusion_pytorch_model.safetensors"))


# --- fixtures `scan` and `setups` (a dataset and its scan, a tiny model and an fp32 cache per family): fixtures.py


def check_final(final: Path, family: Family, trained: dict[str, torch.Tensor] | None = None) -> None:
    """The final model loads with from_pretrained and its denoiser runs a training-shaped step."""
    pipeline = DiffusionPipeline.from_pretrained(str(final))
    denoiser = getattr(pipeline, DENOISER[family])
    objective = objective_for(family, str(final))
    with torch.no_grad():
        loss = objective.loss(denoiser, step_inputs(family), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def prediction(denoiser: torch.nn.Module, family: Family, model: str) -> torch.Tensor:
    """The denoiser's output on one fixed training sample (the same noise and timestep every call)."""
    recorder = Recorder(denoiser)
    with torch.no_grad():
        objective_for(family, model).loss(recorder, step_inputs(family), torch.Generator().manual_seed(0))
    return recorder.calls[-1][2]


def trained_module(model: str, family: Family, settings: LoraSettings, checkpoint: Path) -> torch.nn.Module:
    """The denoiser as training left it, rebuilt without stk's export: the base weights, the same adapter, and the
    adapter's fp32 weights from the DeepSpeed checkpoint (DeepSpeed's own zero_to_fp32 reader)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    denoiser = objective_for(family, model).load_denoiser(torch.float32)
    add_lora(denoiser, settings, family, seed=0)
    saved = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), "the checkpoint holds frozen weights"
    missing, unexpected = denoiser.load_state_dict(saved, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    return denoiser.eval()


def check_lora(out: Path, model: str, family: Family, extra: list[str]) -> None:
    """final/ holds the adapter alone, as each checkpoint's lora/ does; the family's pipeline loads it with
    load_lora_weights and then gives what the trained module gives, not what the base gives."""
    assert sorted(p.name for p in (out / "final").iterdir()) == [LORA_WEIGHTS]  # the adapter, not a 12B model
    checkpoint = out / "checkpoints" / latest(out)
    assert load_file(checkpoint / "lora" / LORA_WEIGHTS).keys() == load_file(out / "final" / LORA_WEIGHTS).keys()
    rank = int(extra[extra.index("--lora-rank") + 1])
    alpha = int(extra[extra.index("--lora-alpha") + 1]) if "--lora-alpha" in extra else rank
    with safe_open(out / "final" / LORA_WEIGHTS, "pt") as f:  # alpha travels with the weights
        assert json.loads(f.metadata()["lora_adapter_metadata"])[f"{DENOISER[family]}.lora_alpha"] == alpha

    pipe = DiffusionPipeline.from_pretrained(model)
    base = prediction(getattr(pipe, DENOISER[family]), family, model)
    pipe.load_lora_weights(out / "final")
    loaded = prediction(getattr(pipe, DENOISER[family]), family, model)
    again = prediction(getattr(pipe, DENOISER[family]), family, model)
    assert torch.equal(loaded, again), "the loaded LoRA is not deterministic (dropout left on?)"
    trained = prediction(trained_module(model, family, LoraSettings(rank, alpha), checkpoint), family, model)
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loaded, base, rtol=1e-4, atol=1e-6), "the LoRA changed nothing"


# --- ZeRO 1, 2 and 3 on each family ------------------------------------------------------------------------------

# Three cells train a LoRA (one per family, one per kind of ZeRO) and load it into the family's pipeline. Every
# cell makes samples at step 0 and 3 (the end), but the last: its resolution cannot be allocated (a round that fails,
# as one out of memory does), which must cost the samples only.
MATRIX = [
    ("zero2", Family.SD, ["--grad-accum", "2", "--lr-schedule", "cosine", "--warmup-steps", "1"]),
    ("zero3", Family.SD, []),
    ("zero1", Family.SDXL, ["--grad-accum", "2", "--lora-rank", "4", "--lora-dropout", "0.1"]),
    ("zero2", Family.SDXL, ["--no-gradient-checkpointing"]),  # the other cells checkpoint (the default)
    ("zero3", Family.SDXL, ["--optimizer", "lion", "--lr", "1e-4"]),
    # the Flux cache holds the prompts (stk-cache --validation-prompts, support/fixtures.py): no text encoder loads; W&B
    ("zero1", Family.FLUX, ["--caption-dropout", "0.5", "--report-to", "wandb"]),
    ("zero2", Family.FLUX, ["--lr-schedule", "cosine", "--precision", "bf16"]),
    ("zero3", Family.FLUX, ["--grad-accum", "2", "--lora-rank", "4"]),
    (
        "zero2-offload",
        Family.SD,
        [
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",  # DeepSpeed's CPU Adam: JIT-built once
            "--validation-resolution",
            "524288x524288",
        ],
    ),
]


@pytest.mark.parametrize(("preset", "family", "extra"), MATRIX, ids=[f"{p}-{f.value}" for p, f, _ in MATRIX])
def test_zero_stage_trains_checkpoints_and_exports(preset, family, extra, setups, scan, tmp_path):
    model, cache = setups(family)
    out = tmp_path / "run"
    proc = run_train(
        ["--cache", cache, "--scan", scan, "--model", model, "--output-dir", out, "--deepspeed", preset,
         "--max-steps", "3", *[a for a in FAST if a != "-q"], *SAMPLING, *extra],
        env={"WANDB_MODE": "offline"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["outcome"] == "finished" and summary["steps"] == 3 and summary["final"] == str(out / "final")
    rows = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["step_time"] > 0 and r["data_wait"] >= 0 for r in rows)
    if "--validation-resolution" in extra:
        failed = [line for line in proc.stderr.splitlines() if "samples at step" in line]
        assert len(failed) == 2 and all("out of memory" in line and "training goes on" in line for line in failed)
        assert not (out / "samples").exists()
    elif "wandb" in extra:
        check_wandb(out, [0, 3])
    else:
        check_samples(out, [0, 3])
    if family is Family.FLUX:
        assert "text encoders" not in proc.stderr, "the prompts' embeddings are in the cache"
    assert latest(out) == "step-00000003"
    if "--lora-rank" in extra:
        check_lora(out, model, family, extra)
        return
    trained = denoiser_weights(out / "final", family)
    source = denoiser_weights(Path(model), family)
    dtype = torch.bfloat16 if "bf16" in extra else torch.float32
    assert trained.keys() == source.keys() and {t.dtype for t in trained.values()} == {dtype}
    assert any(not torch.equal(trained[k].float(), source[k].to(dtype).float()) for k in trained), "nothing trained"
    check_final(out / "final", family)


# --- determinism and resume ------------------------------------------------------------------------------------


def test_loss_falls_on_a_fixed_dataset(setups, scan, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    proc = run_train(
        ["--cache", cache, "--model", model, "--output-dir", out, "--deepspeed", "zero2", "--max-steps", "50",
         "--epochs", "10", "--checkpoint-every", "0", *FAST],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == 50
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, losses


def test_ten_steps_equal_five_then_resume_five(setups, scan, tmp_path):
    """Also: gradient checkpointing (on by default) changes no bit. The straight run keeps its
    activations, the split runs recompute them."""
    model, cache = setups(Family.SDXL)
    common = ["--cache", cache, "--model", model, "--deepspeed", "zero2", "--epochs", "2", "--ema-decay", "0.8", *FAST,
              *SAMPLING, "--validation-every", "5"]  # fmt: skip
    loud = [a for a in common if a != "-q"]  # rank 0's set-up line says whether checkpointing is on
    straight, split = tmp_path / "straight", tmp_path / "split"
    every_step = ["--checkpoint-every", "1", "--keep-checkpoints", "10"]  # each step's weights, for the EMA below
    plain = run_train(
        [*loud, "--output-dir", straight, "--max-steps", "10", "--no-gradient-checkpointing", *every_step]
    )
    assert plain.returncode == 0 and "gradient checkpointing off" in plain.stderr, plain.stderr
    first = run_train([*loud, "--output-dir", split, "--max-steps", "5"])
    assert first.returncode == 0 and summary_of(first)["steps"] == 5
    assert "gradient checkpointing on" in first.stderr, first.stderr
    second = run_train([*common, "--output-dir", split, "--max-steps", "10"])
    assert second.returncode == 0, second.stderr
    assert summary_of(second)["resumed_from"].endswith("step-00000005")
    # same samples, noise and timesteps at every step: the same losses, and bitwise the same weights
    assert [r.get("loss") for r in metrics(straight)][1:] == [r.get("loss") for r in metrics(split)][1:]
    for final in ("final-no-ema", "final"):  # the trained weights, and their EMA sharded over the 2 ranks
        a, b = denoiser_weights(straight / final, Family.SDXL), denoiser_weights(split / final, Family.SDXL)
        assert all(torch.equal(a[k], b[k]) for k in a), final
    # the EMA against one computed here from each step's weights: decay 0 at the first update, then the ramp
    steps = [checkpoint_module(straight, step) for step in range(1, 11)]
    raw = denoiser_weights(straight / "final-no-ema", Family.SDXL)
    assert all(torch.equal(raw[k], steps[-1][k]) for k in raw)
    expected = dict(steps[0])
    for t, weights in enumerate(steps[1:], start=1):
        decay = min(0.8, (1 + t) / (10 + t))
        expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in expected}
    ema = denoiser_weights(straight / "final", Family.SDXL)
    assert all(torch.allclose(ema[k], expected[k], rtol=1e-5, atol=1e-7) for k in ema)
    assert any(not torch.allclose(ema[k], raw[k]) for k in ema)
    # samples: the same PNG bytes from both runs, and those of the final step are what SDXL's own pipeline makes from
    # final/ (the EMA; it encodes the prompts itself), with the same seed, to one level in a few pixels; the raw
    # weights make other images
    for step in (5, 10):
        assert sample_pngs(straight, step) == sample_pngs(split, step), step
    for weights, close in (("final", True), ("final-no-ema", False)):
        pipe = DiffusionPipeline.from_pretrained(straight / weights)
        assert samples_match(pipe, sample_pngs(straight, 10), guidance=5.0) == close, weights


def test_sigusr2_checkpoints_exits_for_requeue_and_the_rerun_resumes(setups, scan, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--deepspeed", "zero3", "--epochs", "50",
            "--checkpoint-every", "0", *FAST]  # fmt: skip
    proc = subprocess.Popen(train_command(args, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=train_env())  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
            time.sleep(0.2)
        assert (out / "metrics.jsonl").exists(), "training did not start"
        ranks = mpi_rank_pids(proc.pid, "stk.cli.train")
        os.kill(ranks[1], signal.SIGUSR2)  # one rank only: the step agreement tells the other
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.REQUEUE, stderr
    summary = json.loads(stdout)
    stopped = summary["steps"]
    assert summary["outcome"] == "requeue" and summary["final"] is None
    assert latest(out) == f"step-{stopped:08d}" and not (out / "final").exists()
    assert "SIGUSR2 received" in stderr

    rerun = run_train([*args[: args.index("--epochs")], "--max-steps", str(stopped + 2), *FAST])
    assert rerun.returncode == 0, rerun.stderr
    resumed = summary_of(rerun)
    assert resumed["resumed_from"].endswith(f"step-{stopped:08d}") and resumed["steps"] == stopped + 2
    assert [r["step"] for r in metrics(out)] == list(range(1, stopped + 3))


def test_vae_on_the_fly_trains_from_the_scan_and_images(setups, scan, tmp_path):
    model, _ = setups(Family.SDXL)
    out = tmp_path / "run"
    proc = run_train(
        ["--vae-on-the-fly", "--scan", scan, "--model", model, "--output-dir", out, "--max-steps", "2",
         "--caption-dropout", "0.5", *FAST], mpi=2,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2] and summary_of(proc)["final"] == str(out / "final")
    check_final(out / "final", Family.SDXL)


def test_trains_from_an_s3_cache_through_a_local_shard_directory(setups, scan, tmp_path, s3_server):
    from support.weed_server import S3_ENV, s3_client, upload_cache

    model, cache = setups(Family.SD)
    url = upload_cache(s3_client(s3_server), cache)
    local, out = tmp_path / "shards", tmp_path / "run"
    proc = run_train(
        ["--cache", url, "--scan", scan, "--model", model, "--output-dir", out, "--max-steps", "2",
         "--local-cache-dir", local, "--s3-endpoint-url", s3_server, *FAST],
        env=S3_ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shards = sorted(p.name.split("-", 1)[1] for p in local.iterdir() if p.suffix == ".h5")
    assert shards == sorted(p.name for p in (cache / "shards").iterdir())  # whole shards, fetched once per node
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_srun_with_pmi2_runs_the_same_command(slurm_cluster, setups, tmp_path):
    """The same command under `srun --mpi=pmi2` of a real one-node Slurm: two tasks find their ranks
    and the rendezvous from MPI and train together."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    env = {**train_env(), "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--max-steps", "2", "--lora-rank", "4", *FAST]
    command = ["timeout", "240", "srun", "--mpi=pmi2", "-n", "2", "-c", "1", *train_command(args)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=260, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["steps"] == 2 and summary["final"] == str(out / "final")
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()  # a LoRA: the same under srun


# --- the GPU circuit breaker --------------------------------------------------------------------------------------


def test_scripted_gpu_fault_stops_every_rank_with_the_gpu_code_and_one_alert(setups, tmp_path, receiver):
    model, cache = setups(Family.SD)
    hook = receiver()
    script = tmp_path / "gpus.json"
    healthy = [gpu(0), gpu(1)]
    script.write_text(json.dumps([healthy] * 6 + [[gpu(0), gpu(1, ecc_volatile_uncorrectable=3)]]))
    out = tmp_path / "run"
    proc = run_train(
        ["--cache", cache, "--model", model, "--output-dir", out, "--deepspeed", "zero2", "--epochs", "50",
         "--health-interval", "0.2", "--notify", hook.url(), "--lora-rank", "4", *FAST],  # a LoRA stops the same
        env={"STK_HEALTH_SCRIPT": str(script), "SLURM_JOB_ID": "4242"},
    )  # fmt: skip
    assert proc.returncode == ExitCode.GPU_FAULT, proc.stderr
    summary = summary_of(proc)
    assert summary["outcome"] == "gpu_fault" and summary["final"] is None
    assert "GPU fault" in proc.stderr
    alerts = hook.bodies
    assert [a["type"] for a in alerts] == ["gpu.fault"], alerts
    assert alerts[0]["rank"] == 1 and alerts[0]["job_id"] == "4242" and alerts[0]["fault"]["gpu"]["index"] == 1


def test_max_steps_past_one_epoch_trains_that_many_and_no_gpu_means_nothing_to_watch(setups, tmp_path):
    """One process, batch 8: an epoch of the 24 images is 3 steps; --max-steps 4 goes on into the second epoch
    (--epochs stays at its default, 1). The same run shows that no GPU leaves nothing to watch."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--max-steps", "4", *FAST[:-1], "--batch-size", 8]
    proc = run_train(args, mpi=0)
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA driver: nothing to watch" in proc.stderr
    assert summary_of(proc)["steps"] == 4
    assert [(row["step"], row["epoch"]) for row in metrics(out)] == [(1, 0.3333), (2, 0.6667), (3, 1.0), (4, 1.3333)]


# --- preflight and bad setups: a clear message and a documented code, before any model loads ---------------------


def test_nodes_with_different_gpu_counts_are_refused(tmp_path):
    code = (
        "from stk.world import get_world\n"
        "from stk.train.preflight import check_gpu_layout\n"
        "from stk.errors import PreflightFailed\n"
        "world = get_world()\n"
        "world.node = f'node{world.rank}'\n"
        "try:\n    check_gpu_layout(world, 8 if world.rank == 0 else 4)\n"
        "except PreflightFailed as exc:\n    print(exc)\n"
    )
    proc = subprocess.run([str(MPIEXEC), "-n", "2", TRAIN[0], "-c", code], capture_output=True, text=True,
                          env=train_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("nodes have different numbers of GPUs (node0: 8, node1: 4)") == 2


@pytest.fixture(scope="module")
def wider_scan(scan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training images (copied with their mtimes, so their cache keys hold) plus two new ones, scanned."""
    import shutil

    from stk.datagen import make_image

    summary = json.loads((scan / "summary.json").read_text())
    data = tmp_path_factory.mktemp("wider") / "data"
    shutil.copytree(summary["root"], data)
    for i in range(2):
        make_image(72, 72, seed=500 + i).save(data / f"extra_{i}.png")
    out = tmp_path_factory.mktemp("wider-scan") / "scan"
    command = [TRAIN[0], "-m", "stk.cli.scan", data, "--out", out, "--resolution", "64", "--alignment", "64", "-q",
               "--allow-oversubscription"]  # fmt: skip
    proc = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=scan_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


BAD_SETUPS = {
    "bucket-too-small": (["--batch-size", "32"], ExitCode.BATCH_CHECK,
                         ["hold fewer samples than the effective batch size 32", "needs --repeats >= 2"]),
    "no-cache": (["--no-cache"], ExitCode.INPUT, ["give --cache"]),
    "on-the-fly-without-scan": (["--no-cache", "--no-scan", "--vae-on-the-fly"], ExitCode.INPUT, ["give --scan"]),
    "family-mismatch": (["--other-model"], ExitCode.INPUT, ["was made for a sd model", "is sdxl"]),
    "deepspeed-not-json": (["--deepspeed", "BAD_JSON"], ExitCode.INPUT, ["not valid JSON"]),
    "deepspeed-missing": (["--deepspeed", "/nonexistent/ds.json"], ExitCode.INPUT, ["No such file", "zero2-offload"]),
    "deepspeed-fp16": (["--deepspeed", "FP16"], ExitCode.INPUT, ["fp16 is not supported"]),
    "resume-missing": (["--resume", "/nonexistent/step-00000001"], ExitCode.INPUT, ["no such checkpoint directory"]),
    "cache-does-not-cover-scan": (["--wider-scan"], ExitCode.INCOMPLETE,
                                  ["2 scan rows have no cached latent", "extra_0.png", "extra_1.png"]),
    "cache-missing": (["--cache", "/nonexistent/cache"], ExitCode.INPUT, ["no manifest.json"]),
    "lora-targets-unknown": (["--lora-rank", "4", "--lora-targets", "to_q,attn3"], ExitCode.INPUT,
                             ["--lora-targets attn3: no such layer in the sd denoiser", "to_out.0, to_q, to_v"]),
    "prompt-file-empty": (["--validation-prompts", "EMPTY"], ExitCode.INPUT, ["no prompts in it (one per line)"]),
    "sample-size-unaligned": (["--validation-prompt", "a", "--validation-resolution", "100x64"], ExitCode.INPUT,
                              ["--validation-resolution 100x64: sd makes images whose sides are multiples of 8"]),
}  # fmt: skip


@pytest.mark.usefixtures("keep_logging")
@pytest.mark.parametrize("case", list(BAD_SETUPS))
def test_bad_setup_gives_its_message_and_code(case, setups, scan, wider_scan, tmp_path):
    """In this process, through click's runner: the same parsing, checks, messages and exit codes as
    from a shell, without paying stk-train's imports (~5 s) once per case."""
    extra, code, messages = BAD_SETUPS[case]
    model, cache = setups(Family.SD)
    (tmp_path / "bad.json").write_text("{ not json")
    (tmp_path / "fp16.json").write_text(json.dumps({"fp16": {"enabled": True}}))
    (tmp_path / "empty.txt").write_text("\n  \n")
    substitutions = {"BAD_JSON": str(tmp_path / "bad.json"), "FP16": str(tmp_path / "fp16.json"),
                     "EMPTY": str(tmp_path / "empty.txt")}  # fmt: skip
    args = ["--cache", cache, "--scan", scan, "--model", model]
    for flag, value in (("--no-cache", cache), ("--no-scan", scan)):
        if flag in extra:
            at = args.index(value)
            args, extra = args[: at - 1] + args[at + 1 :], [e for e in extra if e != flag]
    if "--other-model" in extra:
        args[args.index(model)], extra = setups(Family.SDXL)[0], []
    if "--wider-scan" in extra:
        args[args.index(scan)], extra = wider_scan, []
    extra = [substitutions.get(e, e) for e in extra]
    out = tmp_path / "run"
    argv = [*map(str, [*args, "--output-dir", out, "--max-steps", "1", *FAST, *extra])]
    result = CliRunner().invoke(train_main, argv, env=clean_env(DS_ACCELERATOR="cpu"), catch_exceptions=False)
    assert result.exit_code == code, result.stderr
    for message in messages:
        assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
