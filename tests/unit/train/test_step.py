"""stk.train.step in this process, without mpiexec: optimizer steps of `train_step` on a real DeepSpeed engine of one
rank (the CPU, gloo, DeepSpeed's own init through stk's), against the objective's loss computed directly from the
same cached latents and the step's generator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_batches import cached_batch

from stk.models import Family, build_tiny_model
from stk.models.interface import StepInputs
from stk.models.latents import LatentNorm
from stk.train.data.batch import Batch
from stk.train.deepspeed.config import load_deepspeed_config
from stk.train.deepspeed.engine import build_engine, engine_config
from stk.train.deepspeed.optim import OptimizerSettings
from stk.train.objective.objectives import objective_for
from stk.train.options import TrainOptions
from stk.train.step import StepModel, batch_digest, step_generator, step_inputs, train_step

SCALE = 0.18215  # the tiny SD VAE's scaling factor
SEED = 3


def direct_loss(model: StepModel, micro: Batch, step: int, slot: int) -> float:
    """The objective's loss of one micro-batch as the step should compute it: the latent drawn from the
    distribution with the generator of (seed, step, slot), scaled, then the loss with the same generator."""
    assert micro.mean is not None and micro.logvar is not None and micro.text is not None
    generator = step_generator(SEED, step, slot)
    latent = micro.mean + torch.exp(0.5 * micro.logvar) * torch.randn(micro.mean.shape, generator=generator)
    inputs = StepInputs(latent * SCALE, micro.text, micro.original_size, micro.crop_top_left)
    with torch.no_grad():
        return float(model.objective.loss(model.engine, inputs, generator))


def test_train_step_runs_the_objective_on_the_engine_and_steps_the_optimizer(one_rank, tmp_path: Path) -> None:
    model_dir = build_tiny_model(Family.SD, str(tmp_path / "model"))
    opts = TrainOptions(
        model=model_dir,
        output_dir=str(tmp_path / "out"),
        batch_size=2,
        grad_accum=2,
        seed=SEED,
        optimizer=OptimizerSettings(lr=1e-2),
        gradient_checkpointing=False,
    )
    objective = objective_for(Family.SD, model_dir)
    config = engine_config(opts, load_deepspeed_config("zero2"), "fp32")
    engine = build_engine(objective.load_denoiser(torch.float32), opts, config, "fp32", total_steps=2)
    model = StepModel(objective, engine, None, torch.device("cpu"), torch.float32, LatentNorm(SCALE))
    micro = [
        cached_batch(["a", "b"], 0),
        cached_batch(["c", "d"], 1),
        cached_batch(["e", "f"], 2),
        cached_batch(["g", "h"], 3),
    ]
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}

    expected = [direct_loss(model, micro[0], 0, 0), direct_loss(model, micro[1], 0, 1)]  # slot: micro x ranks + rank
    batches = iter(micro)
    first = train_step(model, batches, step=0, seed=SEED, rank=0, world_size=1, accum=2)
    assert first is not None and first.micro_batches == 2
    assert first.loss == pytest.approx(sum(expected) / 2, rel=1e-6, abs=0)
    assert first.digest == batch_digest(0, ["a", "b"]) + batch_digest(1, ["c", "d"])
    assert engine.global_steps == 1  # one optimizer step for two micro-batches
    changed = [name for name, p in engine.module.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before), f"weights the step left alone: {set(before) - set(changed)}"

    # the next step draws from the next step's generators, on the weights the first step left
    expected = [direct_loss(model, micro[2], 1, 0), direct_loss(model, micro[3], 1, 1)]
    second = train_step(model, batches, step=1, seed=SEED, rank=0, world_size=1, accum=2)
    assert second is not None and second.loss == pytest.approx(sum(expected) / 2, rel=1e-6, abs=0)
    assert second.loss != first.loss
    assert train_step(model, batches, step=2, seed=SEED, rank=0, world_size=1, accum=2) is None  # the epoch's end


def test_a_dataset_s_own_caption_dropout_replaces_the_option_for_its_batches() -> None:
    """ "style" drops every caption, "photos" none, any other dataset (and a run of one) --caption-dropout's 0."""
    batch = cached_batch(["a", "b", "c"], 0)
    assert batch.text is not None
    empty = {name: torch.zeros(values.shape[1:]) for name, values in batch.text.items()}
    model = StepModel(
        None,
        None,
        None,
        torch.device("cpu"),
        torch.float32,
        LatentNorm(SCALE),
        empty,
        0.0,  # type: ignore[arg-type]
        {"style": 1.0, "photos": 0.0},
    )
    for dataset, dropped in [("style", True), ("photos", False), ("", False)]:
        text = step_inputs(batch, model, step_generator(SEED, 0, 0), dataset).text
        for name, values in text.items():
            assert torch.equal(values, torch.zeros_like(values) if dropped else batch.text[name]), dataset
