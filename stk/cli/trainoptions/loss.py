"""stk-train's options for what the loss sees: timesteps, noise, weighting, guidance and dropped captions."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.cli.trainsettings import flow_shift
from stk.train.objective.losses import TIMESTEP_SAMPLINGS, LossSettings
from stk.train.options import TrainOptions

__all__ = ["caption_dropout_option", "guidance_option", "loss_options"]


# The guidance value a guidance-distilled family trains with.
guidance_option = option_group(
    click.option(
        "--guidance-scale",
        default=default_of(TrainOptions, "guidance_scale"),
        type=FiniteFloat(),
        show_envvar=True,
        help="Flux guidance embedding value in training.",
    ),
)


# Timestep sampling, loss weighting and the noise, per family kind.
loss_options = option_group(
    click.option(
        "--snr-gamma",
        default=default_of(LossSettings, "snr_gamma"),
        type=FiniteFloat(),
        show_envvar=True,
        help="SD/SDXL: min-SNR-gamma loss weighting (5 is the paper's); unset: plain MSE.",
    ),
    click.option(
        "--noise-offset",
        default=default_of(LossSettings, "noise_offset"),
        type=FiniteFloat(),
        show_envvar=True,
        help="SD/SDXL: add this times N(0,1) per image and channel to the noise (0.05-0.1 is usual), "
        "so the model learns very dark and very bright images.",
    ),
    click.option(
        "--timestep-sampling",
        type=click.Choice(TIMESTEP_SAMPLINGS),
        show_envvar=True,
        default=default_of(LossSettings, "timestep_sampling"),
        help="Flow families: how u is drawn (sigma is about 1 - u): sigmoid(N(--logit-mean, --logit-std)), "
        "sigmoid(--logit-std * N(0,1)) (kohya's), or uniform [default: the family's diffusers "
        "example's; docs/families, 'Training defaults'].",
    ),
    click.option(
        "--logit-mean",
        default=default_of(LossSettings, "logit_mean"),
        type=FiniteFloat(),
        show_envvar=True,
        help="Flow families, logit-normal: the mean, as diffusers' --logit_mean (> 0 favours less noise).",
    ),
    click.option(
        "--logit-std",
        default=default_of(LossSettings, "logit_std"),
        type=FiniteFloat(),
        show_envvar=True,
        help="Flow families, logit-normal and sigmoid: the spread.",
    ),
    click.option(
        "--flow-shift",
        default=default_of(LossSettings, "flow_shift"),
        callback=flow_shift,
        show_envvar=True,
        help="Flow families: example (the scheduler's training table, as the family's diffusers example "
        "indexes it: shifted only by a static shift in the scheduler's config), "
        "auto (shifted as the pipeline shifts its schedule for the image's size), or a number S "
        "(sigma' = S sigma / (1 + (S-1) sigma)).",
    ),
)


# Captions dropped for classifier-free guidance.
caption_dropout_option = option_group(
    click.option(
        "--caption-dropout",
        default=default_of(LossSettings, "caption_dropout"),
        type=FiniteFloat(0, 1),
        show_envvar=True,
        help="Train each sample on the empty caption with this probability (0.1 is usual), so classifier-"
        "free guidance has an unconditional prediction to work with.",
    ),
)
