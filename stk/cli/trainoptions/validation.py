"""stk-train's options for the sample images of a run and where each step's numbers are reported."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.cli.trainsettings import resolution
from stk.train.options import TrainOptions
from stk.train.reporters import REPORTERS
from stk.train.validation import ValidationSettings

__all__ = ["report_option", "validation_options"]


# Sample images: the prompts, how often, and how they are drawn.
validation_options = option_group(
    click.option(
        "--validation-prompt",
        "validation_prompts",
        multiple=True,
        show_envvar=True,
        help="Make a sample image of this prompt at step 0, every --validation-every steps and at the end, "
        "into OUTPUT/samples/step-N/ and TensorBoard (repeatable) [default: the prompts the cache "
        "holds, from stk-cache --validation-prompts].",
    ),
    click.option(
        "--validation-prompts",
        "validation_prompts_file",
        default=None,
        show_envvar=True,
        help="A file of prompts, one per line, after any --validation-prompt.",
    ),
    click.option(
        "--validation-every",
        default=default_of(ValidationSettings, "every"),
        type=click.IntRange(0),
        show_envvar=True,
        help="Optimizer steps between sample rounds (0: only at step 0 and the end).",
    ),
    click.option(
        "--validation-steps",
        default=None,
        type=click.IntRange(1),
        show_envvar=True,
        help="Inference steps per sample [default: 30; Flux 28].",
    ),
    click.option(
        "--validation-guidance",
        default=None,
        type=FiniteFloat(0),
        show_envvar=True,
        help="Guidance scale of the samples [default: SD 7.5, SDXL 5, Flux 3.5].",
    ),
    click.option(
        "--validation-resolution",
        default=None,
        show_envvar=True,
        callback=lambda _ctx, _param, value: resolution(value),
        help="WIDTHxHEIGHT of the samples [default: the run's most common bucket].",
    ),
    click.option(
        "--validation-seed",
        default=default_of(ValidationSettings, "seed"),
        type=int,
        show_envvar=True,
        help="Prompt k's noise is drawn from this + k: the same image on any number of ranks.",
    ),
    click.option("--no-validation", is_flag=True, show_envvar=True, help="No samples, whatever the cache holds."),
)


# Where rank 0 reports each step besides metrics.jsonl.
report_option = option_group(
    click.option(
        "--report-to",
        type=click.Choice(REPORTERS),
        default=default_of(TrainOptions, "report_to"),
        show_envvar=True,
        help="Where rank 0 also reports each step's numbers and the sample images (metrics.jsonl always): "
        "tensorboard writes OUTPUT/tensorboard/ (tensorboard --logdir OUTPUT/tensorboard); wandb needs "
        "pip install 'stk[wandb]' (WANDB_PROJECT names the project; WANDB_MODE=offline writes "
        "OUTPUT/wandb/ for wandb sync).",
    ),
)
