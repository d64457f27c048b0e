"""stk-train's options for how each optimizer step is made: DeepSpeed's config, the precision, the batch, and the
optimizer with its learning-rate schedule."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.cli.trainsettings import betas
from stk.train.deepspeed.config import PRECISIONS, PRESETS
from stk.train.deepspeed.optim import OPTIMIZERS, SCHEDULES, OptimizerSettings
from stk.train.options import TrainOptions

__all__ = ["batch_options", "optimizer_options"]


# DeepSpeed's config, the training precision, and how many samples make one optimizer step.
batch_options = option_group(
    click.option(
        "--deepspeed",
        default=default_of(TrainOptions, "deepspeed"),
        show_envvar=True,
        help=f"DeepSpeed config: a preset ({', '.join(PRESETS)}) or a JSON file.",
    ),
    click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default=None,
        show_envvar=True,
        help="[default: bf16 on GPU, fp32 on CPU]",
    ),
    click.option(
        "--batch-size",
        default=default_of(TrainOptions, "batch_size"),
        type=click.IntRange(1),
        show_envvar=True,
        help="Samples per GPU per micro-step.",
    ),
    click.option(
        "--grad-accum",
        default=default_of(TrainOptions, "grad_accum"),
        type=click.IntRange(1),
        show_envvar=True,
        help="Micro-steps per optimizer step.",
    ),
    click.option(
        "--max-grad-norm",
        default=default_of(TrainOptions, "max_grad_norm"),
        type=FiniteFloat(0),
        show_envvar=True,
        help="Gradient clipping (0: off).",
    ),
)


# The optimizer, its settings, and the learning rate over the run.
optimizer_options = option_group(
    click.option(
        "--optimizer",
        type=click.Choice(tuple(OPTIMIZERS)),
        default=default_of(OptimizerSettings, "name"),
        show_envvar=True,
    ),
    click.option(
        "--lr",
        default=default_of(OptimizerSettings, "lr"),
        type=FiniteFloat(0, min_open=True),
        show_envvar=True,
        help="Peak learning rate.",
    ),
    click.option(
        "--betas",
        default=",".join(map(str, default_of(OptimizerSettings, "betas"))),
        callback=betas,
        show_envvar=True,
        help="Optimizer betas.",
    ),
    click.option(
        "--weight-decay", default=default_of(OptimizerSettings, "weight_decay"), type=FiniteFloat(0), show_envvar=True
    ),
    click.option(
        "--lr-schedule",
        type=click.Choice(SCHEDULES),
        default=default_of(TrainOptions, "lr_schedule"),
        show_envvar=True,
        help="After warmup: constant, or cosine decay to 0 at the last step.",
    ),
    click.option(
        "--warmup-steps",
        default=default_of(TrainOptions, "warmup_steps"),
        type=click.IntRange(0),
        show_envvar=True,
        help="Linear warmup steps.",
    ),
)
