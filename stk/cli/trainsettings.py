"""stk-train's option values that click's types cannot read alone, and the option groups that become the
library's settings objects (optimizer, adapter, loss, validation)."""

from __future__ import annotations

from typing import Any

import click

from stk.cli.common import FiniteFloat
from stk.errors import InputError
from stk.train.deepspeed.optim import OptimizerSettings
from stk.train.objective.losses import FLOW_SHIFTS, LossSettings
from stk.train.trainable.lora import LoraSettings
from stk.train.validation.plan import ValidationSettings, parse_resolution

__all__ = ["betas", "flow_shift", "resolution", "settings_of"]


def betas(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, float]:
    """--betas: two numbers in [0, 1), comma-separated."""
    try:
        first, second = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give two numbers, like 0.9,0.999") from None
    beta = FiniteFloat(0, 1, max_open=True)
    return beta.convert(first, param, ctx), beta.convert(second, param, ctx)


def flow_shift(ctx: click.Context, param: click.Parameter, value: str | float) -> str | float:
    """--flow-shift: one of FLOW_SHIFTS' names, or a positive number."""
    if value in FLOW_SHIFTS:
        return value
    usage = f"{value!r}: a positive number like 3.0, or one of {', '.join(FLOW_SHIFTS)}"
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(usage) from None
    shift = float(FiniteFloat().convert(number, param, ctx))
    if shift <= 0:
        raise click.BadParameter(usage)
    return shift


def resolution(value: str | None) -> tuple[int, int] | None:
    """--validation-resolution: WIDTHxHEIGHT, refused as click refuses a bad option (exit 2)."""
    if value is None:
        return None
    try:
        return parse_resolution(value)
    except InputError as exc:
        raise click.BadParameter(str(exc)) from None


def settings_of(options: dict[str, Any]) -> dict[str, Any]:
    """The option groups that are settings objects of their own, taken out of `options`."""
    pop = options.pop
    targets = pop("lora_targets")
    loss = (
        "snr_gamma",
        "noise_offset",
        "timestep_sampling",
        "logit_mean",
        "logit_std",
        "flow_shift",
        "caption_dropout",
    )
    validation = ("prompts_file", "every", "steps", "guidance", "resolution", "seed")
    return {
        "optimizer": OptimizerSettings(pop("optimizer"), pop("lr"), pop("betas"), pop("weight_decay")),
        "lora": LoraSettings(
            pop("lora_rank"),
            pop("lora_alpha"),
            pop("lora_dropout"),
            tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else (),
            adapter=pop("adapter"),
            dora=pop("dora"),
        ),
        "loss": LossSettings(**{name: pop(name) for name in loss}),
        "validation": ValidationSettings(
            prompts=tuple(pop("validation_prompts")),
            **{name: pop(f"validation_{name}") for name in validation},
            enabled=not pop("no_validation"),
        ),
    }
