"""stk-cache: click wiring only; the work is in stk.cache."""

from __future__ import annotations

import json
from typing import Any

import click

from stk.cache.inspect import cache_info, verify_cache
from stk.cache.options import CacheOptions
from stk.cache.pipeline import run_cache
from stk.cli.common import (
    CONTEXT,
    common_options,
    default_of,
    max_errors_option,
    options_from,
    run_command,
    run_process,
)
from stk.cluster.world import World
from stk.images.preprocess import CropMode
from stk.models import Family, quiet_model_libraries
from stk.models.families import family_names
from stk.shards.config import EncodeSettings

EPILOG = """\b
Examples:
  stk-cache /shared/run1/scan --model stabilityai/stable-diffusion-xl-base-1.0 --out /shared/run1/cache
  srun --mpi=pmi2 stk-cache scan --model ./my-flux --out s3://bucket/cache --s3-endpoint-url https://r2...
  stk-cache verify /shared/run1/cache --scan /shared/run1/scan
  stk-cache info s3://bucket/cache | jq .samples

\b
Exit codes: 0 done; 2 bad option; 3 scan, model or cache unusable (another config: --force), or the
text encoders do not fit the device (the line names their size, and --two-pass where it helps);
4 more images failed than --max-errors (see CACHE/errors.jsonl); 6 damaged data: a scan table,
manifest or shard that cannot be read (the line names the fix), or verify found missing or
damaged shards or samples; 7 another stk-cache holds --out; 69 a full or read-only disk, S3 down
(rerun once fixed).
"""


class _DefaultBuild(click.Group):
    """`stk-cache SCAN_DIR ...` means `stk-cache build SCAN_DIR ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["build", *args]
        return super().parse_args(ctx, args)


@click.group("cache", cls=_DefaultBuild, context_settings=CONTEXT("cache"), epilog=EPILOG)
def main() -> None:
    """Precompute VAE latents and text embeddings for a scanned dataset into HDF5 shards.

    `stk-cache SCAN_DIR --model MODEL --out CACHE` builds (or finishes) a cache; `verify` and
    `info` inspect one. CACHE is a directory or s3://bucket/prefix.
    """


def _defaults(name: str) -> Any:
    return default_of(CacheOptions, name)


@main.command("build", context_settings=CONTEXT("cache"), epilog=EPILOG)
@click.argument("scan_dir")
@click.option("--model", required=True, show_envvar=True, help="Hub id or local diffusers directory.")
@click.option("--out", required=True, show_envvar=True, help="Cache directory or s3://bucket/prefix.")
@click.option(
    "--family",
    type=click.Choice(family_names()),
    default=None,
    show_envvar=True,
    help="Model family [default: from the model's model_index.json].",
)
@click.option("--device", default=None, show_envvar=True, help="Torch device [default: this rank's GPU, else cpu].")
@click.option(
    "--batch-size",
    default=_defaults("batch_size"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Images per VAE batch.",
)
@click.option(
    "--text-batch-size",
    default=_defaults("text_batch_size"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Captions per batch; captions of similar token counts are batched together.",
)
@click.option(
    "--two-pass",
    is_flag=True,
    show_envvar=True,
    help="Encode the captions with the text encoders alone on the device, then the images with the "
    "VAE alone: for an LLM text encoder that does not fit beside the VAE. Same cache.",
)
@click.option(
    "--shard-size",
    default=_defaults("shard_size") // 2**20,
    type=click.IntRange(1),
    show_envvar=True,
    help="Shard size limit, MiB.",
)
@click.option(
    "--threads",
    default=_defaults("threads"),
    type=click.IntRange(1, 256),
    show_envvar=True,
    help="Decode threads per rank.",
)
@click.option(
    "--crop",
    type=click.Choice([c.value for c in CropMode]),
    show_envvar=True,
    default=default_of(EncodeSettings, "crop").value,
    help="Where to crop an image to its bucket; offsets are stored (SDXL uses them).",
)
@click.option(
    "--latents",
    type=click.Choice(["mean", "params"]),
    show_envvar=True,
    help="Store the latent mean, or mean and log-variance (stk-train then samples the latent anew each "
    "time it sees the image) [default: as the family's diffusers training example: params where "
    "it trains on a sample of the latent distribution, mean where on its mode; docs/families, "
    "'Training defaults']",
)
@click.option(
    "--dtype",
    type=click.Choice(["float16", "float32"]),
    default=default_of(EncodeSettings, "dtype"),
    show_envvar=True,
    help="How latents and embeddings are stored.",
)
@click.option(
    "--trim-padding",
    is_flag=True,
    show_envvar=True,
    help="Store only the real tokens of sequence embeddings (exact only for a denoiser that masks "
    "padding: docs/commands/stk-cache.md).",
)
@click.option(
    "--validation-prompts",
    default=None,
    show_envvar=True,
    help="A file of prompts, one per line, to embed for stk-train's sample images: a run on this "
    "cache then loads no text encoder (Flux's T5: 9 GB) [default: keep the cache's].",
)
@click.option("--force", is_flag=True, show_envvar=True, help="Replace a cache made with another model or config.")
@max_errors_option("images", CacheOptions)
@common_options
def build(verbose: int, quiet: bool, s3_endpoint_url: str | None, s3_retry_seconds: float, **params: Any) -> None:
    """Encode every image and caption of SCAN_DIR (an stk-scan output) into the cache at --out.

    Rerunning the same command finishes an interrupted run: finished shards are kept and their
    samples skipped. Run it under mpiexec or srun to use every rank of the job.
    """
    latents = params["latents"]
    settings = EncodeSettings(
        CropMode(params["crop"]),
        None if latents is None else latents == "params",
        params["dtype"],
        params["trim_padding"],
    )
    opts = options_from(
        CacheOptions,
        params,
        cache=params["out"],
        family=Family(params["family"]) if params["family"] else None,
        shard_size=params["shard_size"] * 2**20,
        settings=settings,
    )

    def body(world: World) -> int:
        quiet_model_libraries()
        summary = run_cache(opts, world)
        if world.is_root:
            print(json.dumps(summary.__dict__))
        return 0

    run_command("stk-cache", verbose, quiet, s3_endpoint_url, body, s3_retry_seconds=s3_retry_seconds)


@main.command("verify", context_settings=CONTEXT("cache"))
@click.argument("cache")
@click.option("--scan", "scan_dir", default=None, show_envvar=True, help="Also check that every scan row is cached.")
@click.option(
    "--repair",
    is_flag=True,
    help="Unlist and delete missing or damaged shards, so a rerun redoes them; rebuild a damaged "
    "manifest.json from the intact shards.",
)
@common_options
def verify_command(
    cache: str,
    scan_dir: str | None,
    repair: bool,
    verbose: int,
    quiet: bool,
    s3_endpoint_url: str | None,
    s3_retry_seconds: float,
) -> None:
    """Check every shard's checksum and, with --scan, that every scan row has its latent and caption.

    Prints a JSON report; exits 6 with the missing or damaged items listed when anything is wrong.
    """

    def body(world: World) -> int:
        report = verify_cache(cache, scan_dir, repair)
        fields = ("ok", "shards", "latents", "texts", "bad_input")
        print(json.dumps({name: getattr(report, name) for name in fields}))
        return 0

    run_command("stk-cache", verbose, quiet, s3_endpoint_url, body, s3_retry_seconds=s3_retry_seconds)


@main.command("info", context_settings=CONTEXT("cache"))
@click.argument("cache")
@common_options
def info_command(cache: str, verbose: int, quiet: bool, s3_endpoint_url: str | None, s3_retry_seconds: float) -> None:
    """Print a JSON summary of CACHE: samples, buckets, bytes, compression ratio, model."""

    def body(world: World) -> int:
        print(json.dumps(cache_info(cache)))
        return 0

    run_command("stk-cache", verbose, quiet, s3_endpoint_url, body, s3_retry_seconds=s3_retry_seconds)


def entry() -> None:
    """The `stk-cache` executable."""
    run_process(main, "stk-cache")


if __name__ == "__main__":
    entry()
