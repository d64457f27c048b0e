"""stk-train's options for the sample images of a run and where each step's numbers are reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.cli.trainsettings import resolution
from stk.train.options import TrainOptions
from stk.train.report.reporters import REPORTERS
from stk.train.validation.plan import ValidationSettings

if TYPE_CHECKING:
    from stk.models.families.spec import FamilySpec

__all__ = ["FamilyHelpOption", "report_option", "validation_options"]


class FamilyHelpOption(click.Option):
    """An option whose default is each family's own: its help names every family's, read from the family specs when
    the help is shown, so it cannot drift from them (the specs import torch and diffusers: too slow to read each
    time the command starts)."""

    def __init__(self, *args: Any, help_of: Callable[[list[FamilySpec]], str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_of = help_of

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from stk.models.families import all_specs

        self.help = self.help_of(all_specs())
        return super().get_help_record(ctx)


def _per_family(specs: list[FamilySpec], value: Callable[[FamilySpec], object]) -> str:
    """Each family's title and its value ("SD 30, SDXL 30, ..."), in the registry's order."""
    return ", ".join(f"{spec.title} {value(spec)}" for spec in specs)


def _steps_help(specs: list[FamilySpec]) -> str:
    return f"Inference steps per sample [default: {_per_family(specs, lambda spec: spec.sampling.steps)}]."


def _guidance_help(specs: list[FamilySpec]) -> str:
    defaults = _per_family(specs, lambda spec: f"{spec.sampling.guidance:g}")
    unguided = [spec.title for spec in specs if not spec.sampling.negative_prompt]
    negative = "classifier-free with the empty caption as the negative prompt"
    if unguided:
        negative += f", except for {', '.join(unguided)}, which take no negative prompt"
    return f"Guidance scale of the samples [default: {defaults}]; {negative}."


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
        cls=FamilyHelpOption,
        help_of=_steps_help,
    ),
    click.option(
        "--validation-guidance",
        default=None,
        type=FiniteFloat(0),
        show_envvar=True,
        cls=FamilyHelpOption,
        help_of=_guidance_help,
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
