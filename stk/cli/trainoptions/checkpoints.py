"""stk-train's options for what the run keeps and how it goes on: checkpoints, resuming, the divergence guard
and the EMA of the weights."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.train.options import TrainOptions

__all__ = ["checkpoint_options", "ema_options"]


# When checkpoints are written and kept, how many bad steps a run rides through, and resuming.
checkpoint_options = option_group(
    click.option(
        "--checkpoint-every",
        default=default_of(TrainOptions, "checkpoint_every"),
        type=click.IntRange(0),
        show_envvar=True,
        help="Optimizer steps between checkpoints (0: only on signals and at the end).",
    ),
    click.option(
        "--keep-checkpoints",
        default=default_of(TrainOptions, "keep_checkpoints"),
        type=click.IntRange(1),
        show_envvar=True,
        help="Newest kept.",
    ),
    click.option(
        "--max-nonfinite-steps",
        default=default_of(TrainOptions, "max_nonfinite_steps"),
        type=click.IntRange(0),
        show_envvar=True,
        help="Steps in a row whose loss or gradient norm is nan or inf that the run rides through (each one a "
        "warning, never checkpointed); one more stops every rank with exit 8, the checkpoints from "
        "before kept and no final/ written.",
    ),
    click.option(
        "--resume",
        default=default_of(TrainOptions, "resume"),
        show_envvar=True,
        help="auto: from the newest checkpoint that verifies, OUTPUT/checkpoints/latest first (falling back "
        "to older ones needs --keep-checkpoints 2 or more); none: start over; a checkpoint directory: "
        "as --resume-from.",
    ),
    click.option(
        "--resume-from",
        metavar="PATH",
        show_envvar=True,
        help="Resume from this checkpoint directory (OUTPUT/checkpoints/step-NNNNNNNN), verified; exit 6 "
        "if it is damaged.",
    ),
    click.option(
        "--override-resume",
        is_flag=True,
        show_envvar=True,
        help="Resume although seed, optimizer, lr, schedule, batch or accumulation differ from the "
        "checkpoint's, or the ranks left cannot keep its effective batch: this run's values apply "
        "from the resumed step on.",
    ),
)


# An EMA of the trained weights, saved as the final model.
ema_options = option_group(
    click.option(
        "--ema-decay",
        default=default_of(TrainOptions, "ema_decay"),
        type=FiniteFloat(0, 1, max_open=True),
        show_envvar=True,
        help="Keep an EMA of the trained weights with this decay (0.9999 is usual; 0: none), sharded "
        "over the ranks in fp32. OUTPUT/final then holds the EMA weights, "
        "OUTPUT/final-no-ema the raw ones.",
    ),
    click.option(
        "--ema-every",
        default=default_of(TrainOptions, "ema_every"),
        type=click.IntRange(1),
        show_envvar=True,
        help="Optimizer steps between EMA updates.",
    ),
)
