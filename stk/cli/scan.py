"""stk-scan: click wiring only; the work is in stk.scan."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from stk.buckets import BucketSpec, ResolutionType
from stk.captions import MissingCaption
from stk.cli.common import (
    CONFIG_FILE,
    CONTEXT,
    FiniteFloat,
    common_options,
    default_of,
    max_errors_option,
    options_from,
    run_command,
    run_process,
)
from stk.cluster.lease import Lease, leased
from stk.cluster.world import World
from stk.datasets import DatasetSpec, datasets_in_config, datasets_toml, read_datasets
from stk.errors import InputError
from stk.images.formats import FORMAT_NAMES, accepted_formats
from stk.log import get_logger
from stk.models.families import Family, family_names
from stk.scan import ScanOptions, run_scan
from stk.scan.datasets import run_datasets
from stk.scan.gpus import training_gpus
from stk.scan.outputs import METADATA
from stk.scan.probe import ProbeOptions
from stk.scan.records import json_lines

log = get_logger("scan")

EPILOG = """\b
Examples:
  stk-scan /data/images --out /shared/scan --batch-size 4 --gpus 32
  stk-scan s3://bucket/images --out /shared/scan --s3-endpoint-url http://minio:9000
  find /data -name '*.jpg' | stk-scan - --out scan --jsonl | jq -r .caption
  stk-scan /data/images --out scan --formats jpeg,png          # only JPEG and PNG
  mpiexec -n 8 stk-scan /data/images --out /shared/scan      # every rank shares the work
  stk-scan --datasets multidatabackend.json --print-config > datasets.toml   # check, then keep it
  stk-scan --datasets datasets.toml --out /shared/scan --batch-size 4

\b
Exit codes: 0 done; 2 bad option; 3 source, dataset list or output unusable;
4 more bad files than --max-errors (outputs written, see errors.jsonl);
5 a bucket cannot fill one effective batch (outputs written; see the message);
7 another stk-scan holds --out (the message names it).
"""


def _stdin_lines() -> list[str]:
    """The list on stdin, one path a line; a name that is not UTF-8 is kept as the file's name."""
    return os.fsdecode(sys.stdin.buffer.read()).splitlines()


def _columns(values: tuple[str, ...]) -> dict[str, str]:
    mapping = {}
    for value in values:
        ours, sep, theirs = value.partition("=")
        if not sep or ours not in ("path", "caption", "width", "height") or not theirs:
            raise click.BadParameter(f"{value!r}: expected OURS=THEIRS with OURS one of path, caption, width, height")
        mapping[ours] = theirs
    return mapping


@click.command("scan", context_settings=CONTEXT("scan"), epilog=EPILOG)
@click.argument("source", required=False)
@click.option(
    "--datasets",
    "datasets_file",
    envvar="STK_SCAN_DATASETS",
    default=None,
    type=click.Path(dir_okay=False),
    show_envvar=True,
    help="Scan several datasets, each with its own settings, instead of SOURCE: stk's TOML ([[dataset]] "
    "tables; --config's own [[dataset]] tables do the same), SimpleTuner's multidatabackend.json or kohya's "
    "dataset TOML. A field a dataset leaves out takes the option of the same name.",
)
@click.option(
    "--print-config",
    is_flag=True,
    help="Print the datasets as stk's TOML (what --datasets understood; warnings on stderr) and exit.",
)
@click.option(
    "--out",
    show_envvar=True,
    help="Scan directory for metadata.parquet, buckets.json, errors.jsonl (shared storage under MPI); required "
    "unless --print-config.",
)
@click.option(
    "--root",
    default=None,
    show_envvar=True,
    help="For a table SOURCE: directory or s3:// prefix its paths are relative to [default: the table's folder].",
)
@click.option(
    "--column",
    multiple=True,
    show_envvar=True,
    help="Map a table column: OURS=THEIRS, e.g. --column path=file_name (repeatable).",
)
@click.option("--full", is_flag=True, show_envvar=True, help="Rescan everything instead of reusing unchanged rows.")
@click.option(
    "--threads",
    default=default_of(ScanOptions, "threads"),
    type=click.IntRange(1, 256),
    show_envvar=True,
    help="I/O threads per rank.",
)
@click.option(
    "--commit-every",
    default=default_of(ScanOptions, "commit_every"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Files per rank between journal commits (what a kill can lose).",
)
@click.option(
    "--max-pixels",
    default=default_of(ProbeOptions, "max_pixels"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Images whose header declares more pixels are errors.",
)
@click.option(
    "--formats",
    default=None,
    show_envvar=True,
    help=f"Accept only these formats, a comma list of: {', '.join(FORMAT_NAMES)} [default: all of them]; "
    "the others become unsupported_format rows.",
)
@click.option(
    "--missing-caption",
    type=click.Choice([m.value for m in MissingCaption]),
    default=default_of(ProbeOptions, "missing_caption").value,
    show_envvar=True,
    help="Caption for an image with no table column and no .txt/.caption sidecar.",
)
@click.option(
    "--resolution",
    default=default_of(BucketSpec, "resolution"),
    type=FiniteFloat(min=0, min_open=True),
    show_envvar=True,
    help="Short edge in pixels (pixel) or megapixels (area).",
)
@click.option(
    "--resolution-type",
    type=click.Choice([r.value for r in ResolutionType]),
    default=default_of(BucketSpec, "resolution_type").value,
    show_envvar=True,
)
@click.option(
    "--family",
    type=click.Choice(family_names()),
    default=None,
    show_envvar=True,
    help="The model family the buckets are for: --alignment defaults to the sides it trains on (16 px for the "
    "flow transformers, 8 for SD and SDXL), and refuses others.",
)
@click.option(
    "--alignment",
    default=None,
    type=click.IntRange(1),
    show_envvar=True,
    help=f"Bucket sides are multiples of this [default: the --family's, else {default_of(BucketSpec, 'alignment')}].",
)
@click.option(
    "--min-aspect",
    default=default_of(BucketSpec, "min_aspect"),
    type=FiniteFloat(min=0, max=1, min_open=True),
    show_envvar=True,
    help="Narrowest width/height kept; narrower images are skipped.",
)
@click.option(
    "--max-aspect",
    default=default_of(BucketSpec, "max_aspect"),
    type=FiniteFloat(min=1),
    show_envvar=True,
    help="Widest width/height kept; wider images are skipped.",
)
@click.option(
    "--min-size",
    default=default_of(ScanOptions, "min_size"),
    type=click.IntRange(0),
    show_envvar=True,
    help="Skip images whose shorter side is below this many pixels.",
)
@click.option(
    "--batch-size",
    default=default_of(ScanOptions, "batch_size"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Training batch size per GPU.",
)
@click.option(
    "--gpus",
    default=None,
    type=click.IntRange(1),
    show_envvar=True,
    help="GPUs in the training job [default: the Slurm allocation, else this node's GPUs (NVML), else 1].",
)
@click.option(
    "--grad-accum",
    default=default_of(ScanOptions, "grad_accum"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Gradient accumulation steps.",
)
@click.option(
    "--repeats",
    default=default_of(ScanOptions, "repeats"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Times each image is seen per epoch.",
)
@click.option(
    "--allow-oversubscription",
    is_flag=True,
    show_envvar=True,
    help="Give short buckets the repeats they need (recorded in buckets.json) instead of failing.",
)
@max_errors_option("files", ScanOptions)
@click.option(
    "--jsonl",
    is_flag=True,
    show_envvar=True,
    help="Write the rows to stdout as JSON lines (default: one JSON summary).",
)
@common_options
def main(
    source: str | None,
    datasets_file: str | None,
    print_config: bool,
    column: tuple[str, ...],
    formats: str | None,
    jsonl: bool,
    verbose: int,
    quiet: bool,
    s3_endpoint_url: str | None,
    s3_retry_seconds: float,
    **params: Any,
) -> None:
    """Find every image under SOURCE and write its size, caption and aspect bucket to --out.

    SOURCE is a directory, s3://bucket/prefix, a .parquet/.jsonl table (from stk or another
    trainer), or - for paths and URLs on stdin. Only image headers are read. Rerunning reuses
    unchanged rows and finishes an interrupted scan. Run it under mpiexec or srun to use every
    rank of the job.

    With --datasets, each dataset is scanned into --out/datasets/NAME and --out holds all of them:
    the table's `dataset` column, each dataset's own buckets and repeats in buckets.json.
    """
    config_file = click.get_current_context().meta.get(CONFIG_FILE)
    if not params["out"] and not print_config:
        raise click.UsageError("Missing option '--out'.")
    mapping = _columns(column)
    try:
        accepted = accepted_formats(formats)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--formats") from None
    family = Family(params["family"]) if params["family"] else None
    probe = ProbeOptions(params["max_pixels"], MissingCaption(params["missing_caption"]), accepted)

    def body(world: World) -> int:
        datasets = _dataset_list(source, datasets_file, config_file, warn=world.is_root)
        if print_config:
            if datasets is None:
                raise InputError("--print-config prints a list of datasets: give --datasets FILE")
            if world.is_root:
                sys.stdout.write(datasets_toml(datasets))
            return 0
        opts = _options(params, source, mapping, probe, family, world)
        with leased(Lease(opts.out_dir, "stk-scan", "--out"), world):  # one scan per --out, held by rank 0
            if datasets is None:
                summary = run_scan(opts, world).__dict__
            else:
                summary = run_datasets(datasets, opts, world, datasets_file or str(config_file))
            if world.is_root and jsonl:
                sys.stdout.writelines(json_lines(os.path.join(opts.out_dir, METADATA)))
            elif world.is_root:
                sys.stdout.write(json.dumps(summary) + "\n")
        return 0

    run_command("stk-scan", verbose, quiet, s3_endpoint_url, body, s3_retry_seconds=s3_retry_seconds)


def _options(
    params: dict[str, Any],
    source: str | None,
    mapping: dict[str, str],
    probe: ProbeOptions,
    family: Family | None,
    world: World,
) -> ScanOptions:
    """The scan's options from the command's (each dataset of a list starts from them)."""
    spec = options_from(
        BucketSpec,
        params,
        resolution_type=ResolutionType(params["resolution_type"]),
        alignment=_alignment(params["alignment"], family),
    )
    spec.validate()
    training, training_from = training_gpus(params["gpus"])
    return options_from(
        ScanOptions,
        params,
        source=source or "",
        out_dir=params["out"],
        stdin_lines=_stdin_lines() if source == "-" and world.is_root else None,
        table_root=params["root"],
        columns=mapping,
        probe=probe,
        buckets=spec,
        gpus=training,
        gpus_from=training_from,
        oversubscribe=params["allow_oversubscription"],
    )


def _dataset_list(
    source: str | None, datasets_file: str | None, config_file: str | None, warn: bool
) -> list[DatasetSpec] | None:
    """The datasets to scan: --datasets FILE, else --config's [[dataset]] tables, else None (SOURCE alone). Every
    rank reads the list; the settings it could not carry over are logged where `warn` (rank 0: once for the job)."""
    datasets = None
    if datasets_file:
        datasets = read_datasets(datasets_file, _log_warning if warn else None).specs
    elif config_file:
        datasets = datasets_in_config(config_file)
    if datasets is not None and source:
        raise InputError(f"give SOURCE ({source}) or a list of datasets, not both")
    if datasets is None and not source:
        raise InputError("give SOURCE (a directory, s3:// prefix, table or -), or --datasets FILE")
    return datasets


def _log_warning(line: str) -> None:
    log.warning("%s", line)


def _alignment(given: int | None, family: Family | None) -> int:
    if family is None:  # no model library to import
        return default_of(BucketSpec, "alignment") if given is None else given
    from stk.models.alignment import scan_alignment

    return scan_alignment(given, family)


def entry() -> None:
    """The `stk-scan` executable."""
    run_process(main, "stk-scan")


if __name__ == "__main__":
    entry()
