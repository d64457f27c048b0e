"""stk.train.trainable.flatweights: the trainable weights as one flat parameter per block, on a real DeepSpeed engine of
one rank (the CPU, gloo), a tiny SD UNet with a real peft LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_batches import cached_batch

from stk.models import Family, build_tiny_model
from stk.models.latents import LatentNorm
from stk.train.deepspeed.config import load_deepspeed_config
from stk.train.deepspeed.engine import build_engine, engine_config
from stk.train.deepspeed.optim import OptimizerSettings
from stk.train.objective.objectives import objective_for
from stk.train.options import TrainOptions
from stk.train.step import StepModel, train_step
from stk.train.trainable.flatweights import FLAT, LAYOUT, PER_WEIGHT, FlatWeights, layout_for, repeated_blocks
from stk.train.trainable.lora import LoraSettings, add_lora

SEED = 3


def _lora_unet(model: str) -> torch.nn.Module:
    denoiser = objective_for(Family.SD, model).load_denoiser(torch.float32)
    add_lora(denoiser, LoraSettings(rank=4), Family.SD, SEED)
    return denoiser


def test_each_repeated_block_is_one_flat_parameter_of_its_weights_in_the_module_s_order(tmp_path: Path) -> None:
    denoiser = _lora_unet(build_tiny_model(Family.SD, str(tmp_path / "model")))
    names = [name for name, p in denoiser.named_parameters() if p.requires_grad]
    before = torch.cat([p.detach().reshape(-1) for p in denoiser.parameters() if p.requires_grad])
    blocks = [name for name, m in denoiser.named_modules() if type(m).__name__ == "BasicTransformerBlock"]

    flat = FlatWeights(denoiser)

    assert torch.equal(torch.cat([f.detach() for f in flat.flats]), before)  # the same weights, the same order
    assert [name for name, p in denoiser.named_parameters() if p.requires_grad] == names  # the module's own
    grouped = [[name for name, p in denoiser.named_parameters() if any(p is q for q, _ in g)] for g in flat.groups]
    assert len(flat.flats) == len(blocks) > 1
    for block, group in zip(blocks, grouped, strict=True):  # the tiny UNet's LoRA targets are all in its blocks
        assert all(name.startswith(f"{block}.") for name in group), (block, group)
    for f, group in zip(flat.flats, flat.groups, strict=True):  # each weight a view of its flat parameter
        for param, _ in group:
            assert param.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()


def test_a_step_trains_the_flat_parameters_and_the_module_reads_them(one_rank, tmp_path: Path) -> None:
    """One optimizer step: the step's gradients reach DeepSpeed through the flat parameters, and the module's weights
    (what the EMA, the checkpoints and the export read) are the updated ones, with their names and shapes."""
    model = build_tiny_model(Family.SD, str(tmp_path / "model"))
    denoiser = _lora_unet(model)
    shapes = {name: p.shape for name, p in denoiser.named_parameters()}
    before = {name: p.detach().clone() for name, p in denoiser.named_parameters() if p.requires_grad}
    opts = TrainOptions(
        model=model,
        output_dir=str(tmp_path / "out"),
        batch_size=2,
        seed=SEED,
        optimizer=OptimizerSettings(lr=1e-2),
        gradient_checkpointing=True,
    )
    config = engine_config(opts, load_deepspeed_config("zero2"), "fp32")
    engine = build_engine(denoiser, opts, config, "fp32", total_steps=1)
    objective = objective_for(Family.SD, model)
    step = StepModel(objective, engine, None, torch.device("cpu"), torch.float32, LatentNorm(0.18215))

    assert train_step(step, iter([cached_batch(["a", "b"], 0)]), 0, SEED, 0, 1, 1) is not None

    assert {name: p.shape for name, p in engine.module.named_parameters()} == shapes
    assert set(engine.module.state_dict()) == set(denoiser.state_dict()) and not any(
        "stk_flat" in key for key in engine.module.state_dict()
    )
    owned = [p for group in engine.optimizer.bit16_groups for p in group]  # DeepSpeed's: one per block
    assert len(owned) == sum(type(m).__name__ == "BasicTransformerBlock" for m in denoiser.modules()) < len(before)
    after = dict(engine.module.named_parameters())
    changed = [name for name, value in before.items() if not torch.equal(after[name].detach(), value)]
    assert sorted(changed) == sorted(before), "every adapter weight moved"


@pytest.mark.parametrize(
    ("stage", "record", "layout"),
    [
        (2, None, FLAT),  # a new run
        (1, {LAYOUT: FLAT, "seed": 0}, FLAT),
        (2, {"seed": 0}, PER_WEIGHT),  # written before the layout was recorded
        (2, {}, PER_WEIGHT),  # a checkpoint without a record
        (3, None, PER_WEIGHT),  # ZeRO-3 partitions each weight itself
    ],
)
def test_a_run_holds_the_weights_as_the_checkpoint_it_resumes(stage: int, record: dict | None, layout: str) -> None:
    assert layout_for(stage, record) == layout


def _engine(model: str, preset: str, layout: str) -> StepModel:
    """The tiny SD UNet, every weight trained, in a DeepSpeed engine of this rank alone with its weights in `layout`."""
    opts = TrainOptions(model=model, output_dir="unused", batch_size=1, seed=SEED, optimizer=OptimizerSettings(lr=1e-2))
    objective = objective_for(Family.SD, model)
    config = engine_config(opts, load_deepspeed_config(preset), "fp32")
    engine = build_engine(objective.load_denoiser(torch.float32), opts, config, "fp32", total_steps=10, layout=layout)
    return StepModel(objective, engine, None, torch.device("cpu"), torch.float32, LatentNorm(0.18215))


def _train(step_model: StepModel, first: int, last: int) -> None:
    for step in range(first, last):
        batch = iter([cached_batch([f"image-{step}"], step)])
        assert train_step(step_model, batch, step=step, seed=SEED, rank=0, world_size=1, accum=1) is not None


@pytest.mark.parametrize(
    ("preset", "record"), [("zero1", {LAYOUT: FLAT}), ("zero2", {LAYOUT: FLAT}), ("zero2", {"seed": SEED})]
)
def test_a_checkpoint_resumes_bitwise_in_the_layout_it_was_written_in(
    preset: str, record: dict, one_rank, tmp_path: Path
) -> None:
    """An engine trains 3 steps, checkpoints and trains 2 more; a new engine in the layout `layout_for` gives for the
    checkpoint's record (a record of before the layout: one parameter per weight) loads it and trains the same 2 to
    the same bits, the module's weights read back as they were."""
    model = build_tiny_model(Family.SD, str(tmp_path / "model"))
    layout = layout_for(2, record)
    first = _engine(model, preset, layout)
    _train(first, 0, 3)
    first.engine.save_checkpoint(str(tmp_path / "ckpt"), tag="step-3")
    saved = {name: p.detach().clone() for name, p in first.engine.module.named_parameters()}
    _train(first, 3, 5)

    resumed = _engine(model, preset, layout)
    resumed.engine.load_checkpoint(str(tmp_path / "ckpt"), tag="step-3")
    assert all(torch.equal(p, saved[name]) for name, p in resumed.engine.module.named_parameters())
    _train(resumed, 3, 5)

    ended = dict(first.engine.module.named_parameters())
    assert all(torch.equal(p, ended[name]) for name, p in resumed.engine.module.named_parameters())


BLOCK_KINDS = [
    (Family.FLUX, {"FluxTransformerBlock", "FluxSingleTransformerBlock"}),
    (Family.SD3, {"JointTransformerBlock"}),
]


@pytest.mark.parametrize(("family", "kinds"), BLOCK_KINDS)
def test_repeated_blocks_are_diffusers_or_the_top_level_block_lists(family, kinds, tmp_path: Path) -> None:
    """FLUX.1 names its blocks (`_repeated_blocks`); SD3 names none, and its `transformer_blocks` are its blocks."""
    denoiser = objective_for(family, build_tiny_model(family, str(tmp_path / "model"))).load_denoiser(torch.float32)
    blocks = repeated_blocks(denoiser)
    assert {type(block).__name__ for _, block in blocks} == kinds
    assert all(dict(denoiser.named_modules())[name] is block for name, block in blocks)
    if family is Family.SD3:
        assert [name for name, _ in blocks] == [f"transformer_blocks.{i}" for i in range(len(blocks))]
