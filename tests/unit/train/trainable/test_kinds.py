"""stk.train.trainable.kinds's adapters in this process, on a real DeepSpeed engine of one rank under ZeRO-3 (the
weights partitioned, so an adapter that reads its base layer's weight outside that layer's forward fails here as on many
ranks): LoHa, LoKr and DoRA train, LoHa and DoRA resume bitwise (5 steps, a checkpoint and 5 more; 5 on a new engine
resumed from the checkpoint), and their final/ loads back through readers stk did not write: peft's PeftModel and
set_peft_model_state_dict for LoHa and LoKr, the pipeline's load_lora_weights for DoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.lora_files import assert_pipeline_loads_it
from support.tiny_batches import cached_batch, step_inputs

from stk.cluster.world import World
from stk.models import Family, build_tiny_model
from stk.models.latents import LatentNorm
from stk.train.checkpoint.store import CheckpointDir, Resume
from stk.train.deepspeed.config import load_deepspeed_config
from stk.train.deepspeed.engine import build_engine, engine_config
from stk.train.deepspeed.optim import OptimizerSettings
from stk.train.objective.objectives import objective_for
from stk.train.options import TrainOptions
from stk.train.step import StepModel, train_step
from stk.train.trainable.kinds import LoraAdapter, PeftAdapter, Trainable, trainable_for
from stk.train.trainable.lora import LORA_WEIGHTS, LoraSettings

SCALE = 0.18215  # the tiny SD VAE's scaling factor
SEED = 3
PEFT_FILES = ["adapter_config.json", "adapter_model.safetensors"]
ADAPTERS = {
    "loha": LoraSettings(rank=4, alpha=8, adapter="loha"),
    "lokr": LoraSettings(rank=4, alpha=8, adapter="lokr"),
    "dora": LoraSettings(rank=4, alpha=8, dora=True),
}
RESUMED = ("loha", "dora")  # one PeftAdapter and the LoraAdapter


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("model") / "sd"))


def engine_for(model: str, settings: LoraSettings) -> tuple[Trainable, StepModel]:
    """The tiny SD denoiser with the adapter, in a DeepSpeed engine of this rank alone, built partitioned under
    ZeRO-3 as stk-train builds it. The adapter's weights are under the preset's persistence threshold, as a real
    adapter's are: DeepSpeed fetches them at their module's first forward (after a resume too), not when another
    module reads them, which DoRA does (lora_A's shape)."""
    opts = TrainOptions(
        model=model, output_dir="unused", batch_size=1, seed=SEED, lora=settings, optimizer=OptimizerSettings(lr=1e-2)
    )
    trainable, objective = trainable_for(opts), objective_for(Family.SD, model)
    config = engine_config(opts, load_deepspeed_config("zero3"), "fp32")
    denoiser = objective.load_denoiser(torch.float32, World(), config)
    trainable.add(denoiser, objective, SEED)
    engine = build_engine(denoiser, opts, config, "fp32", total_steps=10)
    return trainable, StepModel(objective, engine, None, torch.device("cpu"), torch.float32, LatentNorm(SCALE))


def train(model: StepModel, first: int, last: int) -> None:
    batches = iter([cached_batch([f"image-{step}"], step) for step in range(first, last)])
    for step in range(first, last):
        assert train_step(model, batches, step=step, seed=SEED, rank=0, world_size=1, accum=1) is not None


def export(trainable: Trainable, model: StepModel, source: str, out: Path) -> dict[str, torch.Tensor]:
    trainable.export(model.engine, model.objective, source, str(out), rank=0)
    return load_file(out / (LORA_WEIGHTS if type(trainable) is LoraAdapter else PEFT_FILES[1]))


def denoiser_call() -> dict[str, Any]:
    """The tiny SD UNet's arguments for one fixed input."""
    inputs = step_inputs(Family.SD, batch=1)
    return {
        "sample": inputs.latents,
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": inputs.text["prompt_embeds"],
    }


def prediction(denoiser: Any) -> torch.Tensor:
    """The denoiser's output on the fixed input, in eval mode (no dropout)."""
    denoiser.eval()
    with torch.no_grad():
        return denoiser(**denoiser_call(), return_dict=False)[0]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_under_zero3_resumes_bitwise_and_loads_back(name, model, one_rank, tmp_path):
    """One engine trains 5 steps, checkpoints and trains 5 more (as stk-train's runs that checkpoint every step do);
    a new engine resumed from the checkpoint trains the same 5 to the same bits. LoKr trains and loads back without
    the resume: its checkpoint and resume are LoHa's (PeftAdapter's, whatever peft module it holds)."""
    settings = ADAPTERS[name]
    trainable, straight = engine_for(model, settings)
    assert type(trainable) is (PeftAdapter if settings.adapter != "lora" else LoraAdapter)
    checkpoints = CheckpointDir(str(tmp_path / "split"), keep=1, rank=0, frozen_base=trainable.frozen_base)
    train(straight, 0, 5)
    if name in RESUMED:
        beside = lambda folder: trainable.save_beside(straight.engine, straight.objective, folder, 0)  # noqa: E731
        tag = checkpoints.save(straight.engine, 5, {"stk": {"step": 5}}, {}, also=beside)
        held = sorted(p.name for p in (tmp_path / "split" / "checkpoints" / tag / "lora").iterdir())
        assert held == (PEFT_FILES if settings.adapter != "lora" else [LORA_WEIGHTS])
    train(straight, 5, 10)
    expected = export(trainable, straight, model, tmp_path / "final")

    if name in RESUMED:
        _, second = engine_for(model, settings)
        checkpoints.load(second.engine, Resume(checkpoints.path, tag))
        train(second, 5, 10)
        resumed = export(trainable, second, model, tmp_path / "resumed")
        assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)

    if settings.adapter == "lora":  # DoRA: the LoRA format, with its magnitudes
        straight.engine.module.eval()
        assert_pipeline_loads_it(Family.SD, model, tmp_path / "final", straight.engine.module, **denoiser_call())
    else:
        assert_peft_loads_it(model, tmp_path / "final", prediction(straight.engine.module))


def assert_peft_loads_it(model: str, folder: Path, trained: torch.Tensor) -> None:
    """peft, given final/ on the pipeline's own denoiser, predicts what the trained module does, and not what the base
    does: through PeftModel.from_pretrained, and through set_peft_model_state_dict on an adapter made from the saved
    config."""
    from peft import PeftConfig, PeftModel, inject_adapter_in_model, set_peft_model_state_dict

    denoiser = objective_for(Family.SD, model).load_denoiser(torch.float32)
    base = prediction(denoiser)
    loaded = prediction(PeftModel.from_pretrained(denoiser, str(folder)))
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loaded, base, rtol=1e-4, atol=1e-6), "the adapter changed nothing"

    denoiser = objective_for(Family.SD, model).load_denoiser(torch.float32)
    inject_adapter_in_model(PeftConfig.from_pretrained(str(folder)), denoiser)
    result = set_peft_model_state_dict(denoiser, load_file(folder / PEFT_FILES[1]))
    assert not result.unexpected_keys
    torch.testing.assert_close(prediction(denoiser), trained, rtol=1e-5, atol=1e-6)
