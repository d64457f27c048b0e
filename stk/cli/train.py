"""stk-train: click wiring only; the work is in stk.train."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from typing import Any, TextIO

import click

from stk.cli.common import CONTEXT, common_options, options_from, run_command, run_process
from stk.cli.trainoptions.adapters import adapter_options
from stk.cli.trainoptions.checkpoints import checkpoint_options, ema_options
from stk.cli.trainoptions.compute import compile_options, fp8_option
from stk.cli.trainoptions.data import epoch_options, input_options, loading_options
from stk.cli.trainoptions.faults import fault_options
from stk.cli.trainoptions.loss import caption_dropout_option, guidance_option, loss_options
from stk.cli.trainoptions.optimizer import batch_options, optimizer_options
from stk.cli.trainoptions.validation import report_option, validation_options
from stk.cli.trainsettings import settings_of
from stk.cluster.world import World
from stk.models import Family
from stk.train.options import TrainOptions

EPILOG = """\b
Examples:
  mpiexec -n 2 stk-train --cache demo/cache --model demo/tiny-sdxl --output-dir demo/run --max-steps 20
  srun --mpi=pmi2 stk-train --config run.toml          # [train] table: every option below
  stk-launch -- --cache s3://bucket/cache --scan /shared/scan --model ./sdxl --output-dir /shared/run

\b
Outputs (in --output-dir, which every rank must share): checkpoints/ (DeepSpeed, `latest` moved
only after every rank saved), metrics.jsonl (one line per step), tensorboard/, samples/step-N/
(with --validation-prompt), final/ (diffusers model; with --ema-decay the EMA, final-no-ema/ the
raw weights; with --lora-rank the adapter's files).
A summary JSON line goes to stdout.

\b
Exit codes: 0 finished; 2 bad option; 3 unusable input (cache, model, config; a cache made with
another VAE or text encoders: --force); 5 a bucket cannot fill one effective batch; 6 the cache
does not cover the scan, or a shard is damaged (stk-cache verify CACHE --repair, then stk-cache),
or no checkpoint verifies (the message names the files); 7 preflight failed (output dir not
shared or in use by another run, uneven GPUs); 8 training diverged (more than
--max-nonfinite-steps nan/inf steps in a row, or non-finite weights): nothing saved from it, resume
an earlier checkpoint with a lower --lr; 69 a peer rank, storage or the network failed, a
checkpoint could not be written, or another process's build of DeepSpeed's ops outlasted
$STK_BUILD_WAIT_SECONDS (retry, maybe elsewhere); 75 checkpointed on SIGUSR2/SIGTERM (before
the first step: stopped at once), requeue the job to continue; 76 GPU fault (circuit breaker open);
1 a bug (traceback in the log).
"""


@click.command("train", context_settings=CONTEXT("train"), epilog=EPILOG)
@input_options
@batch_options
@optimizer_options
@epoch_options
@guidance_option
@checkpoint_options
@loss_options
@ema_options
@caption_dropout_option
@validation_options
@report_option
@compile_options
@adapter_options
@fp8_option
@loading_options
@fault_options
@common_options
def main(verbose: int, quiet: bool, s3_endpoint_url: str | None, s3_retry_seconds: float, **options: Any) -> None:
    """Fine-tune a diffusion model of any family stk knows (--family) with DeepSpeed from an stk-cache cache.

    Run it under mpiexec, srun --mpi=pmi2|pmix, or stk-launch: it finds its rank and rendezvous
    itself. Rerunning the same command continues from the latest checkpoint.
    """
    settings = settings_of(options)
    resume_from = options.pop("resume_from")
    if resume_from:
        if options["resume"] not in ("auto", resume_from):
            raise click.UsageError(f"--resume {options['resume']} and --resume-from {resume_from}: give one")
        options["resume"] = resume_from
    size = options["local_cache_size"]
    opts = options_from(
        TrainOptions,
        options,
        **settings,
        family=Family(options["family"]) if options["family"] else None,
        local_cache_bytes=int(size * 2**30) if size else None,
        notify_urls=tuple(options["notify_urls"]),
    )

    summary_out = _keep_stdout_for_data()

    def body(world: World) -> int:
        _quiet_libraries(verbose)
        from stk.train.run import run_train

        summary, code = run_train(opts, world)
        if world.is_root:
            print(json.dumps(summary.to_dict()), file=summary_out, flush=True)
        return int(code)

    run_command("stk-train", verbose, quiet, s3_endpoint_url, body, s3_retry_seconds=s3_retry_seconds)


def _keep_stdout_for_data() -> TextIO:
    """stdout carries the summary line only. DeepSpeed prints build and config notices to stdout
    (some from handlers made at import), so file descriptor 1 becomes stderr for the whole process
    and the summary goes to a duplicate of the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(real, "w")


def _quiet_libraries(verbose: int) -> None:
    """DeepSpeed logs every config value and torch warns about its own deprecations on each step."""
    from stk.models import quiet_model_libraries

    quiet_model_libraries()
    if not verbose:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        warnings.filterwarnings("ignore", category=UserWarning, module="deepspeed")


def entry() -> None:
    """The `stk-train` executable."""
    run_process(main, "stk-train")


if __name__ == "__main__":
    entry()
