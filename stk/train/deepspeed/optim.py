"""The optimizer and learning-rate schedule: AdamW (default) or Lion, warmup then constant or cosine.

stk passes torch's AdamW or lion-pytorch's Lion to DeepSpeed as a client optimizer; when DeepSpeed
must build its own (optimizer offload), the same settings go into the config's optimizer section
and it builds its CPU Adam or Lion. The schedule is diffusers' get_scheduler, the one every
diffusers training example uses, stepped by the DeepSpeed engine once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "OptimizerSettings",
    "apply_optimizer_settings",
    "client_optimizer",
    "lr_schedule",
    "optimizer_section",
]

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimizerSettings:
    name: str = "adamw"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    eps: float = 1e-8


# the client optimizer over the trainable parameters, from its hyperparameters
Builder = Callable[[list[torch.nn.Parameter], dict[str, Any]], torch.optim.Optimizer]


def _adamw(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> torch.optim.Optimizer:
    fused = torch.cuda.is_available()  # one kernel for all parameters on GPU; the foreach path on CPU
    return torch.optim.AdamW(params, **hyper, fused=fused)


def _lion(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    optimizer: torch.optim.Optimizer = Lion(params, **hyper)
    return optimizer


# --optimizer name -> (its client optimizer, the type DeepSpeed builds itself when it offloads the optimizer, the
# OptimizerSettings fields it takes): one line per optimizer
OPTIMIZERS: dict[str, tuple[Builder, str, tuple[str, ...]]] = {
    "adamw": (_adamw, "AdamW", ("lr", "betas", "weight_decay", "eps")),
    "lion": (_lion, "Lion", ("lr", "betas", "weight_decay")),
}


def _kind(settings: OptimizerSettings) -> tuple[Builder, str, dict[str, Any]]:
    """The optimizer's builder, DeepSpeed type and hyperparameters."""
    if settings.name not in OPTIMIZERS:
        raise ValueError(f"optimizer {settings.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    build, deepspeed_type, fields = OPTIMIZERS[settings.name]
    return build, deepspeed_type, {name: getattr(settings, name) for name in fields}


def client_optimizer(params: Iterable[torch.nn.Parameter], settings: OptimizerSettings) -> torch.optim.Optimizer:
    build, _, hyper = _kind(settings)
    return build([p for p in params if p.requires_grad], hyper)


def optimizer_section(settings: OptimizerSettings) -> dict[str, Any]:
    """The DeepSpeed config's optimizer section for the same settings (its CPU Adam/Lion when offloading)."""
    _, deepspeed_type, hyper = _kind(settings)
    return {"type": deepspeed_type, "params": {**hyper, "betas": list(settings.betas)}}


def lr_schedule(kind: str, warmup_steps: int, total_steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """A factory DeepSpeed calls with the optimizer it ends up with (client or its own)."""
    from diffusers.optimization import get_scheduler

    name = {"constant": "constant_with_warmup", "cosine": "cosine"}.get(kind)
    if name is None:
        raise ValueError(f"schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")

    def build(optimizer: torch.optim.Optimizer) -> Any:
        return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1))

    return build


def apply_optimizer_settings(optimizer: Any, settings: OptimizerSettings, schedule: Any, step: int) -> None:
    """Put this run's settings back after a checkpoint's optimizer state was loaded (loading restores
    the saved learning rate, betas and weight decay with the moments), and move the schedule, built
    for this run, to `step`."""
    for group in optimizer.param_groups:
        group.update(lr=settings.lr, initial_lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    schedule.base_lrs = [settings.lr] * len(optimizer.param_groups)
    schedule.last_epoch = step - 1
    schedule.step()  # sets each group's lr for `step`
