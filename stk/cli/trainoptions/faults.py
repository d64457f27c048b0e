"""stk-train's options for faults: who is told of a GPU fault, how often GPUs are checked, and how long a rank
waits for its peers."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.train.options import TrainOptions

__all__ = ["fault_options"]


# Alerts, GPU health sampling and the collective timeout.
fault_options = option_group(
    click.option(
        "--notify",
        "notify_urls",
        multiple=True,
        show_envvar=True,
        help="Apprise URL for the gpu.fault alert (repeatable); prefer --notify-config.",
    ),
    click.option(
        "--notify-config",
        default=None,
        type=click.Path(dir_okay=False),
        show_envvar=True,
        help="Apprise config file with the alert targets.",
    ),
    click.option(
        "--health-interval",
        default=default_of(TrainOptions, "health_interval"),
        type=FiniteFloat(0.1),
        show_envvar=True,
        help="Seconds between GPU health samples in each rank.",
    ),
    click.option(
        "--collective-timeout",
        default=default_of(TrainOptions, "collective_timeout"),
        type=FiniteFloat(1),
        show_envvar=True,
        help="Seconds a rank waits for its peers in one collective (and the rendezvous): a rank that "
        "died or hangs ends the job with exit 69 after this long. Longer than rank 0 takes to export "
        "the model.",
    ),
)
