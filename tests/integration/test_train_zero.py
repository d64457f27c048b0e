"""stk-train end to end with ZeRO 1, 2 and 3 on each family: it trains, checkpoints and exports a model (or a LoRA
its pipeline loads), with samples and metrics.

Real DeepSpeed engines on the CPU under `mpiexec -n 2`, tiny random-weight pipelines and caches made by stk-cache
(fixtures `scan` and `setups`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from support.commands import FAST, run_train, summary_of
from support.fixtures import PROMPTS_CACHED
from support.tiny_batches import Recorder, step_inputs
from support.train_checks import check_final, denoiser_folder, denoiser_weights, latest
from support.train_outputs import SAMPLING, board_images, metrics, sample_pngs, wandb_history

from stk.models import Family
from stk.train.objective.objectives import objective_for
from stk.train.trainable.flatweights import unflattened
from stk.train.trainable.lora import LORA_WEIGHTS, LoraSettings, add_lora

pytestmark = pytest.mark.integration


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


def prediction(denoiser: torch.nn.Module, family: Family, model: str) -> torch.Tensor:
    """The denoiser's output on one fixed training sample (the same noise and timestep every call)."""
    recorder = Recorder(denoiser)
    with torch.no_grad():
        objective_for(family, model).loss(recorder, step_inputs(family), torch.Generator().manual_seed(0))
    return recorder.calls[-1][2]


def trained_module(model: str, family: Family, settings: LoraSettings, checkpoint: Path) -> torch.nn.Module:
    """The denoiser as training left it, rebuilt without stk's export: the base weights, the same adapter, and the
    adapter's fp32 weights from the DeepSpeed checkpoint (DeepSpeed's own zero_to_fp32 reader; under ZeRO-1/2 the run's
    flat parameters, cut back into the adapter's weights by stk.train.trainable.flatweights)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    denoiser = objective_for(family, model).load_denoiser(torch.float32)
    add_lora(denoiser, settings, family, seed=0)
    saved = unflattened(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name), denoiser)
    buffers = dict(denoiser.named_buffers())  # DeepSpeed keeps the module's buffers (SD3's position table)
    adapter = {name for name, p in denoiser.named_parameters() if p.requires_grad}
    assert saved and all(k in adapter or k in buffers for k in saved), "frozen weights saved"
    missing, unexpected = denoiser.load_state_dict(saved, strict=False)
    assert not unexpected and not adapter & set(missing)
    return denoiser.eval()


def adapter_of(extra: list[str]) -> LoraSettings:
    """The adapter a cell's options train."""
    rank = int(extra[extra.index("--lora-rank") + 1])
    alpha = int(extra[extra.index("--lora-alpha") + 1]) if "--lora-alpha" in extra else rank
    kind = extra[extra.index("--adapter") + 1] if "--adapter" in extra else "lora"
    return LoraSettings(rank, alpha, adapter=kind, dora="--dora" in extra)


def check_lora(out: Path, model: str, family: Family, extra: list[str]) -> None:
    """final/ holds the adapter alone, as each checkpoint's lora/ does; the family's pipeline loads it with
    load_lora_weights (LoHa and LoKr: peft's PeftModel on the pipeline's denoiser) and then gives what the trained
    module gives, not what the base gives."""
    settings = adapter_of(extra)
    files = [LORA_WEIGHTS] if settings.adapter == "lora" else ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in (out / "final").iterdir()) == files  # the adapter, not a 12B model
    checkpoint = out / "checkpoints" / latest(out)
    assert load_file(checkpoint / "lora" / files[-1]).keys() == load_file(out / "final" / files[-1]).keys()
    if settings.adapter == "lora":  # alpha travels with the weights
        with safe_open(out / "final" / LORA_WEIGHTS, "pt") as f:
            metadata = json.loads(f.metadata()["lora_adapter_metadata"])
        assert metadata[f"{denoiser_folder(family)}.lora_alpha"] == settings.scale_alpha
        assert metadata[f"{denoiser_folder(family)}.use_dora"] == settings.dora

    pipe = DiffusionPipeline.from_pretrained(model)
    base = prediction(getattr(pipe, denoiser_folder(family)), family, model)
    if settings.adapter == "lora":
        pipe.load_lora_weights(out / "final")
        denoiser = getattr(pipe, denoiser_folder(family))
    else:
        from peft import PeftModel

        denoiser = PeftModel.from_pretrained(getattr(pipe, denoiser_folder(family)), str(out / "final")).eval()
    loaded = prediction(denoiser, family, model)
    again = prediction(denoiser, family, model)
    assert torch.equal(loaded, again), "the loaded adapter is not deterministic (dropout left on?)"
    trained = prediction(trained_module(model, family, settings, checkpoint), family, model)
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loaded, base, rtol=1e-4, atol=1e-6), "the adapter changed nothing"


# Cells that train an adapter load it into the family's pipeline (LoHa and LoKr through peft). Every cell makes
# samples at step 0 and 3 (the end), but the last: its resolution cannot be allocated (a round that fails, as one out
# of memory does), which must cost the samples only.
MATRIX = [
    ("zero2", Family.SDXL, ["--no-gradient-checkpointing"]),  # the other cells checkpoint (the default)
    # the Flux cache holds the prompts (stk-cache --validation-prompts, support/fixtures.py): no text encoder loads; W&B
    ("zero1", Family.FLUX, ["--caption-dropout", "0.5", "--report-to", "wandb"]),
    # one cell per newer family, each on another stage: SD3.5's LoKr (the position table a buffer beside it) under
    # ZeRO-1 with accumulation and rank dropout (the loaded adapter must be deterministic); a DoRA in ChromaPipeline
    # (FLUX.1's blocks) under ZeRO-3 with accumulation and captions of unequal length padded together (dropout to the
    # empty caption); Z-Image's list-in transformer fully trained with an EMA under ZeRO-2; FLUX.2-klein fully trained
    # in bf16 with a warm-up and a cosine schedule under ZeRO-2 (its VAE's batch-norm statistics normalise the cached
    # latents); a LoHa in QwenImagePipeline under ZeRO-3 with masked captions and dropout (its video VAE's one-frame
    # latents); FLUX.2-dev fully trained with Lion and an EMA under ZeRO-3, as its 32B need (built partitioned, the EMA
    # partitioned alike). To keep the suite under 30 minutes they replace cells of the older families that these cover:
    # SDXL's ZeRO-1 LoRA (SDXL's LoRA in test_train_lora.py), SD's and SDXL's ZeRO-3 (a UNet under ZeRO-3: the worldsize
    # test's LoRA and test_train_weights.py's partitioned load), SD's ZeRO-2 (SDXL's), FLUX.1's ZeRO-3 LoRA (Chroma's
    # covers its blocks) and FLUX.1's ZeRO-2 bf16 cell (FLUX.2-klein's). LoKr, DoRA and LoHa took over cells that
    # trained a LoRA (a LoRA under ZeRO-3: test_train_lora.py; in each family's pipeline: its unit tests).
    ("zero1", Family.SD3, ["--lora-rank", "4", "--grad-accum", "2", "--adapter", "lokr", "--lora-dropout", "0.1"]),
    ("zero3", Family.CHROMA, ["--lora-rank", "4", "--caption-dropout", "0.5", "--grad-accum", "2", "--dora"]),
    ("zero2", Family.ZIMAGE, ["--ema-decay", "0.9"]),
    ("zero2", Family.FLUX2_KLEIN, ["--lr-schedule", "cosine", "--warmup-steps", "1", "--precision", "bf16"]),
    ("zero3", Family.QWENIMAGE, ["--lora-rank", "4", "--caption-dropout", "0.5", "--adapter", "loha"]),
    ("zero3", Family.FLUX2, ["--ema-decay", "0.9", "--optimizer", "lion", "--lr", "1e-4"]),
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
        [
            "--cache",
            cache,
            "--scan",
            scan,
            "--model",
            model,
            "--output-dir",
            out,
            "--deepspeed",
            preset,
            "--max-steps",
            "3",
            *[a for a in FAST if a != "-q"],
            *SAMPLING,
            *extra,
        ],
        env={"WANDB_MODE": "offline"},
    )
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
    if family in PROMPTS_CACHED:
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
