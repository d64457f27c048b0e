"""What a run trains: every weight of the denoiser, or an adapter on the frozen denoiser. The trainable decides how it
is added to the denoiser, what a checkpoint holds of it besides DeepSpeed's files, and what OUTPUT/final is. A new
adapter type is a class here (its settings beside stk.train.trainable.lora's) and a line in `trainable_for`.
"""

from __future__ import annotations

import os
from typing import Any

from stk.log import get_logger
from stk.train.deepspeed.engine import full_state_dict
from stk.train.objective.objectives import Objective
from stk.train.options import TrainOptions
from stk.train.trainable.lora import LoraSettings, add_lora, check_targets, lora_state_dict, save_lora, save_peft
from stk.train.trainable.pipeline import export_pipeline

__all__ = ["FullWeights", "LoraAdapter", "PeftAdapter", "Trainable", "trainable_for"]

log = get_logger("train")


class Trainable:
    """What every trainable answers; the defaults are those of training every weight."""

    frozen_base = False  # whether the denoiser's own weights stay --model's (not in checkpoints, loaded non-strict)
    what = "model"  # what OUTPUT/final holds, as the log names it

    def check(self, objective: Objective) -> None:
        """InputError for settings this model cannot take; before any model loads (rank 0)."""

    def add(self, denoiser: Any, objective: Objective, seed: int) -> None:
        """Make `denoiser` train this (before DeepSpeed wraps it)."""

    def save_beside(self, engine: Any, objective: Objective, folder: str, rank: int) -> list[str]:
        """What a checkpoint in `folder` holds of it besides DeepSpeed's files; the files this rank wrote.
        Collective."""
        return []

    def export(self, engine: Any, objective: Objective, model: str, out: str, rank: int) -> None:
        """OUTPUT/final (or final-no-ema) from the engine's weights and the source `model`. Collective."""
        raise NotImplementedError


class FullWeights(Trainable):
    """Every weight of the denoiser: checkpoints hold them all, final/ is the source pipeline with them."""

    def export(self, engine: Any, objective: Objective, model: str, out: str, rank: int) -> None:
        """Under ZeRO-3 every rank gathers, rank 0 writes."""
        state = full_state_dict(engine)
        if rank == 0:
            assert state is not None
            module = engine.module
            export_pipeline(model, objective.denoiser_subfolder, type(module), dict(module.config), state, out)


class LoraAdapter(Trainable):
    """A LoRA (or DoRA) through peft on the frozen denoiser: checkpoints hold the adapter (and lora/, to try
    mid-run), final/ is the adapter as `pipe.load_lora_weights` reads it."""

    frozen_base = True

    def __init__(self, settings: LoraSettings) -> None:
        self.settings = settings
        self.what = settings.name

    def check(self, objective: Objective) -> None:
        check_targets(self.settings, objective)

    def add(self, denoiser: Any, objective: Objective, seed: int) -> None:
        layers = add_lora(denoiser, self.settings, objective.family, seed)
        log.info(
            "%s of rank %d (alpha %d) on %d layers; the base weights frozen",
            self.what,
            self.settings.rank,
            self.settings.scale_alpha,
            layers,
        )

    def save_beside(self, engine: Any, objective: Objective, folder: str, rank: int) -> list[str]:
        out = os.path.join(folder, "lora")
        self._save(engine, objective, out, rank)
        return [os.path.join(out, name) for name in sorted(os.listdir(out))] if rank == 0 else []

    def export(self, engine: Any, objective: Objective, model: str, out: str, rank: int) -> None:
        self._save(engine, objective, out, rank)

    def _save(self, engine: Any, objective: Objective, out: str, rank: int) -> None:
        """The adapter as `pipe.load_lora_weights(out)` reads it. Collective: every rank gathers, rank 0 writes."""
        state = lora_state_dict(engine)
        if rank == 0:
            assert state is not None
            config = engine.module.peft_config["default"]
            self._write(objective, config, state, out)

    def _write(self, objective: Objective, config: Any, state: dict[str, Any], out: str) -> None:
        save_lora(objective.pipeline_class, objective.denoiser_subfolder, config, state, out)


class PeftAdapter(LoraAdapter):
    """A LyCORIS adapter (LoHa, LoKr) through peft, trained and checkpointed as the LoRA is; final/ and each
    checkpoint's lora/ hold it in peft's format (adapter_config.json, adapter_model.safetensors), for
    `PeftModel.from_pretrained` on the pipeline's denoiser: load_lora_weights does not read these adapters."""

    def _write(self, objective: Objective, config: Any, state: dict[str, Any], out: str) -> None:
        save_peft(config, state, out)


def trainable_for(opts: TrainOptions) -> Trainable:
    """What `opts` trains; its settings checked (InputError), before any model loads."""
    opts.lora.check()
    if not opts.lora.enabled:
        return FullWeights()
    return LoraAdapter(opts.lora) if opts.lora.adapter == "lora" else PeftAdapter(opts.lora)
