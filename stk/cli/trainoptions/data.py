"""stk-train's options for what the run trains on (the cache or scan, the model, where outputs go), how long
and in what order it goes through the samples, and how the ranks read the shards."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.models.families import family_names
from stk.train.options import TrainOptions

__all__ = ["epoch_options", "input_options", "loading_options"]


# The cache or scan, the model and its family, and the shared output directory.
input_options = option_group(
    click.option(
        "--cache", default=None, show_envvar=True, help="stk-cache output: a directory or s3://bucket/prefix."
    ),
    click.option(
        "--scan",
        default=None,
        show_envvar=True,
        help="stk-scan output: checks the cache covers it; trains on its rows with its repeats.",
    ),
    click.option("--model", required=True, show_envvar=True, help="Hub id or local diffusers directory to fine-tune."),
    click.option("--output-dir", required=True, show_envvar=True, help="Shared directory for checkpoints and outputs."),
    click.option(
        "--family",
        type=click.Choice(family_names()),
        default=None,
        show_envvar=True,
        help="Model family [default: from the model's model_index.json].",
    ),
    click.option(
        "--vae-on-the-fly",
        is_flag=True,
        show_envvar=True,
        help="Encode images and captions each step from --scan instead of reading a cache.",
    ),
)


# How long the run is and in what order, and how often, it sees the samples.
epoch_options = option_group(
    click.option("--epochs", default=default_of(TrainOptions, "epochs"), type=click.IntRange(1), show_envvar=True),
    click.option(
        "--max-steps",
        default=None,
        type=click.IntRange(1),
        show_envvar=True,
        help="Train this many optimizer steps, as many epochs as they take (wins over --epochs).",
    ),
    click.option(
        "--seed",
        default=default_of(TrainOptions, "seed"),
        show_envvar=True,
        help="Sample order, noise and timesteps all follow from it.",
    ),
    click.option(
        "--repeats",
        default=None,
        type=click.IntRange(1),
        show_envvar=True,
        help="Repeats for every bucket [default: the scan's per-bucket repeats, else 1].",
    ),
    click.option(
        "--allow-oversubscription",
        is_flag=True,
        show_envvar=True,
        help="Repeat short buckets until each fills one effective batch, instead of failing.",
    ),
)


# How each rank fetches, checks and loads the shards.
loading_options = option_group(
    click.option(
        "--local-cache-dir",
        default=None,
        show_envvar=True,
        help="Node-local directory for whole S3 shards, may be shared by the node's ranks "
        "[default: a temp dir per rank].",
    ),
    click.option(
        "--local-cache-size",
        default=None,
        type=FiniteFloat(0, min_open=True),
        show_envvar=True,
        help="GiB of S3 shards kept in --local-cache-dir, least recently used out, shards in use "
        "by any rank kept [default: no limit].",
    ),
    click.option(
        "--check-shards/--no-check-shards",
        default=default_of(TrainOptions, "check_shards"),
        show_envvar=True,
        help="Check each shard's sha256 against the manifest before its first sample is used (a local cache: "
        "one read of each shard per rank; S3: as it downloads).",
    ),
    click.option(
        "--force",
        is_flag=True,
        show_envvar=True,
        help="Train on a cache made with another VAE or other text encoders than --model's "
        "(weights, scaling or shift factor).",
    ),
    click.option(
        "--loader-threads",
        default=default_of(TrainOptions, "loader_threads"),
        type=click.IntRange(1, 64),
        show_envvar=True,
    ),
    click.option(
        "--prefetch",
        default=default_of(TrainOptions, "prefetch"),
        type=click.IntRange(1),
        show_envvar=True,
        help="Micro-batches loaded ahead.",
    ),
)
