"""stk-train: click wiring only; the work is in stk.train."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from typing import Any, TextIO

import click

from stk.cli.common import CONTEXT, FiniteFloat, common_options, default_of, options_from, run_command, run_process
from stk.cli.trainsettings import betas, flow_shift, resolution, settings_of
from stk.models import Family
from stk.models.families import family_names
from stk.train.baseprecision import BASE_PRECISIONS
from stk.train.dsconfig import PRECISIONS, PRESETS
from stk.train.lora import ADAPTERS, LoraSettings
from stk.train.losses import TIMESTEP_SAMPLINGS, LossSettings
from stk.train.optim import OPTIMIZERS, SCHEDULES, OptimizerSettings
from stk.train.options import TrainOptions
from stk.train.reporters import REPORTERS
from stk.train.validation import ValidationSettings
from stk.world import World

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


def _default(name: str) -> Any:
    return default_of(TrainOptions, name)


@click.command("train", context_settings=CONTEXT("train"), epilog=EPILOG)
@click.option("--cache", default=None, show_envvar=True, help="stk-cache output: a directory or s3://bucket/prefix.")
@click.option("--scan", default=None, show_envvar=True,
              help="stk-scan output: checks the cache covers it; trains on its rows with its repeats.")  # fmt: skip
@click.option("--model", required=True, show_envvar=True, help="Hub id or local diffusers directory to fine-tune.")
@click.option("--output-dir", required=True, show_envvar=True, help="Shared directory for checkpoints and outputs.")
@click.option("--family", type=click.Choice(family_names()), default=None, show_envvar=True,
              help="Model family [default: from the model's model_index.json].")  # fmt: skip
@click.option("--vae-on-the-fly", is_flag=True, show_envvar=True,
              help="Encode images and captions each step from --scan instead of reading a cache.")  # fmt: skip
@click.option("--deepspeed", default=_default("deepspeed"), show_envvar=True,
              help=f"DeepSpeed config: a preset ({', '.join(PRESETS)}) or a JSON file.")  # fmt: skip
@click.option("--precision", type=click.Choice(PRECISIONS), default=None, show_envvar=True,
              help="[default: bf16 on GPU, fp32 on CPU]")  # fmt: skip
@click.option(
    "--batch-size",
    default=_default("batch_size"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Samples per GPU per micro-step.",
)
@click.option(
    "--grad-accum",
    default=_default("grad_accum"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Micro-steps per optimizer step.",
)
@click.option(
    "--max-grad-norm",
    default=_default("max_grad_norm"),
    type=FiniteFloat(0),
    show_envvar=True,
    help="Gradient clipping (0: off).",
)
@click.option(
    "--optimizer", type=click.Choice(tuple(OPTIMIZERS)), default=default_of(OptimizerSettings, "name"), show_envvar=True
)
@click.option(
    "--lr",
    default=default_of(OptimizerSettings, "lr"),
    type=FiniteFloat(0, min_open=True),
    show_envvar=True,
    help="Peak learning rate.",
)
@click.option(
    "--betas",
    default=",".join(map(str, default_of(OptimizerSettings, "betas"))),
    callback=betas,
    show_envvar=True,
    help="Optimizer betas.",
)
@click.option(
    "--weight-decay", default=default_of(OptimizerSettings, "weight_decay"), type=FiniteFloat(0), show_envvar=True
)
@click.option("--lr-schedule", type=click.Choice(SCHEDULES), default=_default("lr_schedule"), show_envvar=True,
              help="After warmup: constant, or cosine decay to 0 at the last step.")  # fmt: skip
@click.option(
    "--warmup-steps",
    default=_default("warmup_steps"),
    type=click.IntRange(0),
    show_envvar=True,
    help="Linear warmup steps.",
)
@click.option("--epochs", default=_default("epochs"), type=click.IntRange(1), show_envvar=True)
@click.option("--max-steps", default=None, type=click.IntRange(1), show_envvar=True,
              help="Train this many optimizer steps, as many epochs as they take (wins over --epochs).")  # fmt: skip
@click.option(
    "--seed", default=_default("seed"), show_envvar=True, help="Sample order, noise and timesteps all follow from it."
)
@click.option("--repeats", default=None, type=click.IntRange(1), show_envvar=True,
              help="Repeats for every bucket [default: the scan's per-bucket repeats, else 1].")  # fmt: skip
@click.option("--allow-oversubscription", is_flag=True, show_envvar=True,
              help="Repeat short buckets until each fills one effective batch, instead of failing.")  # fmt: skip
@click.option(
    "--guidance-scale",
    default=_default("guidance_scale"),
    type=FiniteFloat(),
    show_envvar=True,
    help="Flux guidance embedding value in training.",
)
@click.option("--checkpoint-every", default=_default("checkpoint_every"), type=click.IntRange(0), show_envvar=True,
              help="Optimizer steps between checkpoints (0: only on signals and at the end).")  # fmt: skip
@click.option(
    "--keep-checkpoints",
    default=_default("keep_checkpoints"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Newest kept.",
)
@click.option("--max-nonfinite-steps", default=_default("max_nonfinite_steps"), type=click.IntRange(0),
              show_envvar=True,
              help="Steps in a row whose loss or gradient norm is nan or inf that the run rides through (each one a "
                   "warning, never checkpointed); one more stops every rank with exit 8, the checkpoints from "
                   "before kept and no final/ written.")  # fmt: skip
@click.option("--resume", default=_default("resume"), show_envvar=True,
              help="auto: from the newest checkpoint that verifies, OUTPUT/checkpoints/latest first (falling back "
                   "to older ones needs --keep-checkpoints 2 or more); none: start over; a checkpoint directory: "
                   "as --resume-from.")  # fmt: skip
@click.option("--resume-from", metavar="PATH", show_envvar=True,
              help="Resume from this checkpoint directory (OUTPUT/checkpoints/step-NNNNNNNN), verified; exit 6 "
                   "if it is damaged.")  # fmt: skip
@click.option("--override-resume", is_flag=True, show_envvar=True,
              help="Resume although seed, optimizer, lr, schedule, batch or accumulation differ from the "
                   "checkpoint's, or the ranks left cannot keep its effective batch: this run's values apply "
                   "from the resumed step on.")  # fmt: skip
@click.option("--snr-gamma", default=default_of(LossSettings, "snr_gamma"), type=FiniteFloat(), show_envvar=True,
              help="SD/SDXL: min-SNR-gamma loss weighting (5 is the paper's); unset: plain MSE.")  # fmt: skip
@click.option("--noise-offset", default=default_of(LossSettings, "noise_offset"), type=FiniteFloat(), show_envvar=True,
              help="SD/SDXL: add this times N(0,1) per image and channel to the noise (0.05-0.1 is usual), "
                   "so the model learns very dark and very bright images.")  # fmt: skip
@click.option("--timestep-sampling", type=click.Choice(TIMESTEP_SAMPLINGS), show_envvar=True,
              default=default_of(LossSettings, "timestep_sampling"),
              help="Flow families: how u is drawn (sigma is about 1 - u): sigmoid(N(--logit-mean, --logit-std)), "
                   "sigmoid(--logit-std * N(0,1)) (kohya's), or uniform [default: the family's diffusers "
                   "example's; docs/families, 'Training defaults'].")  # fmt: skip
@click.option("--logit-mean", default=default_of(LossSettings, "logit_mean"), type=FiniteFloat(), show_envvar=True,
              help="Flow families, logit-normal: the mean, as diffusers' --logit_mean (> 0 favours less "
                   "noise).")  # fmt: skip
@click.option("--logit-std", default=default_of(LossSettings, "logit_std"), type=FiniteFloat(), show_envvar=True,
              help="Flow families, logit-normal and sigmoid: the spread.")  # fmt: skip
@click.option("--flow-shift", default=default_of(LossSettings, "flow_shift"),
              callback=flow_shift, show_envvar=True,
              help="Flow families: example (the scheduler's training table, as the family's diffusers example "
                   "indexes it: shifted only by a static shift in the scheduler's config), "
                   "auto (shifted as the pipeline shifts its schedule for the image's size), or a number S "
                   "(sigma' = S sigma / (1 + (S-1) sigma)).")  # fmt: skip
@click.option("--ema-decay", default=_default("ema_decay"), type=FiniteFloat(0, 1, max_open=True),
              show_envvar=True,
              help="Keep an EMA of the trained weights with this decay (0.9999 is usual; 0: none), sharded "
                   "over the ranks in fp32. OUTPUT/final then holds the EMA weights, "
                   "OUTPUT/final-no-ema the raw ones.")  # fmt: skip
@click.option("--ema-every", default=_default("ema_every"), type=click.IntRange(1), show_envvar=True,
              help="Optimizer steps between EMA updates.")  # fmt: skip
@click.option("--caption-dropout", default=default_of(LossSettings, "caption_dropout"), type=FiniteFloat(0, 1),
              show_envvar=True,
              help="Train each sample on the empty caption with this probability (0.1 is usual), so classifier-"
                   "free guidance has an unconditional prediction to work with.")  # fmt: skip
@click.option("--validation-prompt", "validation_prompts", multiple=True, show_envvar=True,
              help="Make a sample image of this prompt at step 0, every --validation-every steps and at the end, "
                   "into OUTPUT/samples/step-N/ and TensorBoard (repeatable) [default: the prompts the cache "
                   "holds, from stk-cache --validation-prompts].")  # fmt: skip
@click.option("--validation-prompts", "validation_prompts_file", default=None, show_envvar=True,
              help="A file of prompts, one per line, after any --validation-prompt.")  # fmt: skip
@click.option("--validation-every", default=default_of(ValidationSettings, "every"), type=click.IntRange(0),
              show_envvar=True,
              help="Optimizer steps between sample rounds (0: only at step 0 and the end).")  # fmt: skip
@click.option("--validation-steps", default=None, type=click.IntRange(1), show_envvar=True,
              help="Inference steps per sample [default: 30; Flux 28].")  # fmt: skip
@click.option("--validation-guidance", default=None, type=FiniteFloat(0), show_envvar=True,
              help="Guidance scale of the samples [default: SD 7.5, SDXL 5, Flux 3.5].")  # fmt: skip
@click.option("--validation-resolution", default=None, show_envvar=True,
              callback=lambda _ctx, _param, value: resolution(value),
              help="WIDTHxHEIGHT of the samples [default: the run's most common bucket].")  # fmt: skip
@click.option("--validation-seed", default=default_of(ValidationSettings, "seed"), type=int, show_envvar=True,
              help="Prompt k's noise is drawn from this + k: the same image on any number of ranks.")  # fmt: skip
@click.option("--no-validation", is_flag=True, show_envvar=True, help="No samples, whatever the cache holds.")
@click.option("--report-to", type=click.Choice(REPORTERS), default=_default("report_to"), show_envvar=True,
              help="Where rank 0 also reports each step's numbers and the sample images (metrics.jsonl always): "
                   "tensorboard writes OUTPUT/tensorboard/ (tensorboard --logdir OUTPUT/tensorboard); wandb needs "
                   "pip install 'stk[wandb]' (WANDB_PROJECT names the project; WANDB_MODE=offline writes "
                   "OUTPUT/wandb/ for wandb sync).")  # fmt: skip
@click.option(
    "--compile",
    "compile_mode",
    default=None,
    show_envvar=True,
    type=click.Choice(["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]),
    help="torch.compile each of the denoiser's repeated blocks in this mode, the code kept in "
    "OUTPUT/compile-cache for a resumed run; a block that fails to compile trains eager [default: "
    "eager].",
)
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=_default("gradient_checkpointing"),
              show_envvar=True,
              help="Recompute the denoiser's activations in the backward pass instead of keeping them: far less "
                   "memory, one more forward pass of each block, the same math.")  # fmt: skip
@click.option("--lora-rank", default=default_of(LoraSettings, "rank"), type=int, show_envvar=True,
              help="Train an adapter (--adapter) of this rank on the frozen model instead of every weight (0: full "
                   "fine-tune). LoRA: the inner width of its two factors; LoHa: that of each of its two pairs of "
                   "factors; LoKr: that of the Kronecker product's second factor (a full matrix where the rank is at "
                   "least half its side). OUTPUT/final and each checkpoint's lora/ then hold the adapter.")  # fmt: skip
@click.option("--adapter", type=click.Choice(ADAPTERS), default=default_of(LoraSettings, "adapter"),
              show_envvar=True,
              help="lora: pytorch_lora_weights.safetensors, for pipe.load_lora_weights. loha, lokr (LyCORIS, through "
                   "peft): adapter_config.json and adapter_model.safetensors, for peft's PeftModel.from_pretrained "
                   "on the pipeline's denoiser (load_lora_weights does not read them).")  # fmt: skip
@click.option("--dora", is_flag=True, show_envvar=True,
              help="With --adapter lora: DoRA (peft's use_dora), the weights' magnitude trained apart from their "
                   "direction; saved as a LoRA is, for pipe.load_lora_weights.")  # fmt: skip
@click.option("--lora-alpha", default=None, type=int, show_envvar=True,
              help="Each --adapter's update is scaled by alpha / rank [default: the rank].")  # fmt: skip
@click.option("--lora-dropout", default=default_of(LoraSettings, "dropout"), type=FiniteFloat(), show_envvar=True,
              help="LoRA: dropout on the adapter's input. LoHa, LoKr: peft's rank dropout, rows of the weight "
                   "update dropped. Training only.")  # fmt: skip
@click.option("--lora-targets", default=None, show_envvar=True,
              help="Comma list of the layers to adapt (for each --adapter), each by its name or the end of it "
                   "(to_q,to_v) [default: the attention projections; for Flux also its feed-forward "
                   "layers].")  # fmt: skip
@click.option("--base-precision", type=click.Choice(BASE_PRECISIONS), default=_default("base_precision"),
              show_envvar=True,
              help="With an adapter: hold the frozen model's linear layers in 8 bits, quantised as they load "
                   "(torchao), about half the memory of the base on every rank; int8 on any device (slower steps "
                   "on a CPU), fp8 on GPUs of compute capability 8.9+ (H100). bf16: not quantised, the training "
                   "dtype. Not with full fine-tuning or ZeRO-3; resume keeps it.")  # fmt: skip
@click.option(
    "--fp8-matmuls",
    is_flag=True,
    show_envvar=True,
    help="The linear layers of the denoiser's repeated blocks multiply in float8, forward and backward (torchao's "
    "float8 training; the weights trained in the training dtype): full fine-tuning or the frozen base of an adapter, "
    "on GPUs of compute capability 8.9+ (H100); best with --compile. Not with --base-precision int8/fp8; resume "
    "keeps it.",
)
@click.option("--local-cache-dir", default=None, show_envvar=True,
              help="Node-local directory for whole S3 shards, may be shared by the node's ranks "
                   "[default: a temp dir per rank].")  # fmt: skip
@click.option("--local-cache-size", default=None, type=FiniteFloat(0, min_open=True), show_envvar=True,
              help="GiB of S3 shards kept in --local-cache-dir, least recently used out, shards in use "
                   "by any rank kept [default: no limit].")  # fmt: skip
@click.option("--check-shards/--no-check-shards", default=_default("check_shards"), show_envvar=True,
              help="Check each shard's sha256 against the manifest before its first sample is used (a local cache: "
                   "one read of each shard per rank; S3: as it downloads).")  # fmt: skip
@click.option("--force", is_flag=True, show_envvar=True,
              help="Train on a cache made with another VAE or other text encoders than --model's "
                   "(weights, scaling or shift factor).")  # fmt: skip
@click.option("--loader-threads", default=_default("loader_threads"), type=click.IntRange(1, 64), show_envvar=True)
@click.option(
    "--prefetch",
    default=_default("prefetch"),
    type=click.IntRange(1),
    show_envvar=True,
    help="Micro-batches loaded ahead.",
)
@click.option("--notify", "notify_urls", multiple=True, show_envvar=True,
              help="Apprise URL for the gpu.fault alert (repeatable); prefer --notify-config.")  # fmt: skip
@click.option("--notify-config", default=None, type=click.Path(dir_okay=False), show_envvar=True,
              help="Apprise config file with the alert targets.")  # fmt: skip
@click.option("--health-interval", default=_default("health_interval"), type=FiniteFloat(0.1), show_envvar=True,
              help="Seconds between GPU health samples in each rank.")  # fmt: skip
@click.option("--collective-timeout", default=_default("collective_timeout"), type=FiniteFloat(1),
              show_envvar=True,
              help="Seconds a rank waits for its peers in one collective (and the rendezvous): a rank that "
              "died or hangs ends the job with exit 69 after this long. Longer than rank 0 takes to export "
              "the model.")  # fmt: skip
@common_options
def main(verbose: int, quiet: bool, s3_endpoint_url: str | None, s3_retry_seconds: float, **options: Any) -> None:
    """Fine-tune a diffusion model (any --family: SD, SDXL, FLUX.1 and .2, SD3.5, Chroma, Z-Image, Qwen-Image) with
    DeepSpeed from an stk-cache cache.

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
