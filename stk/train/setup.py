"""Everything the step loop needs, set up on every rank once the guards have passed: the process group, the sampler,
the embeddings of the validation prompts and the empty caption, the denoiser with its trainable in the DeepSpeed
engine, the checkpoint resumed from, and the components that act beside the loop (checkpointer, validator, hooks,
GPU watch, metrics).
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from stk.cluster.world import World
from stk.errors import InputError
from stk.health.breaker import GpuWatch
from stk.log import get_logger
from stk.progress import Progress
from stk.prompts import EMPTY_CAPTION
from stk.train.checkpoint.checkpointer import Checkpointer
from stk.train.checkpoint.store import CheckpointDir, Resume
from stk.train.data.datasets import caption_dropouts
from stk.train.data.plan import TrainPlan, check_text_encoders_in_train
from stk.train.data.sampler import BucketSampler
from stk.train.deepspeed.config import zero_stage
from stk.train.deepspeed.distributed import DistEnv, init_distributed, resolve_dist_env
from stk.train.deepspeed.engine import build_engine, engine_config
from stk.train.hooks import TrainHook, hooks_for
from stk.train.objective.objectives import objective_for
from stk.train.options import TrainOptions
from stk.train.report.divergence import NonFiniteSteps
from stk.train.report.metrics import MetricsLog
from stk.train.step import StepModel
from stk.train.stopping import StopSignals
from stk.train.trainable import fp8
from stk.train.trainable.flatweights import LAYOUT, PER_WEIGHT, layout_for
from stk.train.trainable.kinds import Trainable
from stk.train.validation.embeddings import Embeddings, embed_captions
from stk.train.validation.plan import ValidationPlan
from stk.train.validation.validator import Validator

__all__ = ["Trainer", "setup"]

log = get_logger("train")


@dataclass
class Trainer:
    """The step loop's state: set up once, advanced by each optimizer step."""

    opts: TrainOptions
    plan: TrainPlan
    sampler: BucketSampler
    model: StepModel
    rank: int
    checkpointer: Checkpointer
    metrics: MetricsLog
    signals: StopSignals
    watch: GpuWatch
    progress: Progress
    total_steps: int
    first_step: int
    step: int
    trainable: Trainable
    nonfinite: NonFiniteSteps  # the run's non-finite steps, and whether they stop it
    hooks: list[TrainHook] = field(default_factory=list)
    validator: Validator | None = None
    hosts: dict[str, int] = field(default_factory=dict)  # host -> ranks on it
    loss: float | None = None  # the last step's, averaged over ranks; None where it was not finite
    samples_per_dataset: dict[str, int] = field(default_factory=dict)  # trained by this run, with several datasets


@dataclass(frozen=True)
class Setting:
    """What the guards settled, for the setup: the run's plan, config, trainable and checkpoint to resume."""

    opts: TrainOptions
    plan: TrainPlan
    validation: ValidationPlan | None
    deepspeed_config: dict[str, Any]
    trainable: Trainable
    checkpoints: CheckpointDir
    resume: Resume | None
    overridden: list[str]  # the settings --override-resume changed


def setup(setting: Setting, world: World, signals: StopSignals) -> Trainer:
    """Everything the step loop needs, the checkpoint resumed from loaded."""
    opts, plan, resume = setting.opts, setting.plan, setting.resume
    env, device, precision = _start_distributed(opts, world)
    sampler, total_steps = _sampler(opts, plan, env)
    embeddings = _embeddings(opts, world, plan, setting.validation, device, precision)  # before the denoiser
    layout = _layout(setting, world, env.rank)
    model = _load_model(setting, world, device, precision, total_steps, embeddings, layout)
    settings = {**plan.run_settings(opts, sampler.world_size), LAYOUT: layout}  # recorded in each checkpoint
    checkpointer = Checkpointer(
        setting.checkpoints, opts.checkpoint_every, settings, opts.seed, plan.family, setting.trainable
    )
    step, nonfinite = checkpointer.resume(model.engine, sampler, resume, opts, setting.overridden) if resume else (0, 0)
    checkpointer.hooks = hooks = hooks_for(opts, model.engine.module, env.rank, env.world_size, resume)
    watch = GpuWatch(
        None,
        interval=opts.health_interval,
        notify_urls=opts.notify_urls,
        notify_config=opts.notify_config,
        rank=env.rank,
    )
    metrics = MetricsLog(opts.output_dir, env.rank == 0, opts.report_to)
    validator = None
    if setting.validation is not None:
        validator = Validator(
            setting.validation,
            model.objective,
            model.engine.module,
            embeddings,
            device,
            model.dtype,
            env.rank,
            env.world_size,
            opts.output_dir,
        )
    return Trainer(
        opts,
        plan,
        sampler,
        model,
        env.rank,
        checkpointer,
        metrics,
        signals,
        watch,
        Progress(world, total_steps - step, "steps", "train"),
        total_steps,
        first_step=step,
        step=step,
        trainable=setting.trainable,
        hooks=hooks,
        validator=validator,
        nonfinite=NonFiniteSteps(opts.max_nonfinite_steps, env.rank, total=nonfinite),
        hosts=dict(sorted(Counter(world.allgather(world.node)).items())),
    )


def _start_distributed(opts: TrainOptions, world: World) -> tuple[DistEnv, torch.device, str]:
    """The process group, this rank's device and the precision it trains in."""
    env = resolve_dist_env(world, os.environ)
    init_distributed(env, timeout=datetime.timedelta(seconds=opts.collective_timeout))
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return env, device, opts.precision or ("bf16" if device.type == "cuda" else "fp32")


def dtype_of(precision: str) -> torch.dtype:
    """The dtype the denoiser (and whatever runs beside it) computes in."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _sampler(opts: TrainOptions, plan: TrainPlan, env: DistEnv) -> tuple[BucketSampler, int]:
    """This rank's sampler and the optimizer steps to train."""
    sampler = BucketSampler(
        plan.groups,
        plan.repeats,
        opts.batch_size,
        env.world_size,
        env.rank,
        opts.grad_accum,
        opts.seed,
        weights=plan.weights,
    )
    if not sampler.steps_per_epoch:
        raise InputError("no bucket fills one effective batch: nothing to train (see the bucket check above)")
    # --max-steps wins over --epochs either way, as every peer's max_train_steps does: the epochs follow from it
    total_steps = opts.max_steps or sampler.steps_per_epoch * opts.epochs
    log.info(
        "%s: %d samples in %d buckets, %d optimizer steps per epoch of %d samples each; training %d steps",
        plan.family.value,
        sum(len(k) for k in plan.groups.values()),
        len(plan.groups),
        sampler.steps_per_epoch,
        sampler.effective_batch,
        total_steps,
    )
    return sampler, total_steps


def _layout(setting: Setting, world: World, rank: int) -> str:
    """How the trainable weights are held (stk.train.trainable.flatweights): as the checkpoint resumed holds them."""
    resume = setting.resume
    resumed = world.root_call(lambda: setting.checkpoints.saved_settings(resume)) if resume is not None else None
    layout = layout_for(zero_stage(setting.deepspeed_config), resumed)
    if rank == 0 and resumed is not None and layout == PER_WEIGHT and zero_stage(setting.deepspeed_config) < 3:
        log.info(
            "the checkpoint resumed holds one DeepSpeed parameter per weight: this run keeps that layout "
            "(a new run holds them flat, one per block, for a faster step)"
        )
    return layout


def _load_model(
    setting: Setting,
    world: World,
    device: torch.device,
    precision: str,
    total_steps: int,
    embeddings: Embeddings,
    layout: str,
) -> StepModel:
    """The denoiser with its trainable in its DeepSpeed engine (and the encoders, with --vae-on-the-fly); from a
    universal checkpoint where the one resumed was saved on another number of ranks."""
    opts, plan = setting.opts, setting.plan
    dtype = dtype_of(precision)
    objective = objective_for(plan.family, opts.model, opts.guidance_scale, opts.loss)
    universal = setting.resume is not None and setting.resume.universal
    config = engine_config(opts, setting.deepspeed_config, precision, universal)
    zero3 = config if zero_stage(config) == 3 else None  # built partitioned: no rank ever holds the whole model
    denoiser = world.run_everywhere(lambda: objective.load_denoiser(dtype, world, zero3, opts.base_precision))
    if opts.fp8_matmuls:
        fp8.convert(denoiser)  # before the adapters, which then wrap the float8 layers
    setting.trainable.add(denoiser, objective, opts.seed)
    denoiser = denoiser.to(device)
    encoders, norm = None, plan.norm  # a cache's recorded normalisation
    if opts.vae_on_the_fly:
        from stk.models import load_encoders

        encoders = world.run_everywhere(lambda: load_encoders(opts.model, plan.family, device, dtype))
        norm = encoders.norm  # the VAE's own
    assert norm is not None
    engine = build_engine(denoiser, opts, config, precision, total_steps, layout)
    dropouts = caption_dropouts(plan.datasets, opts.loss.caption_dropout)
    empty = embeddings.get(EMPTY_CAPTION) if _drops_captions(opts, plan) else None
    return StepModel(
        objective,
        engine,
        encoders,
        device,
        dtype,
        norm,
        empty,
        opts.loss.caption_dropout,
        dropouts,
    )


def _drops_captions(opts: TrainOptions, plan: TrainPlan) -> bool:
    """Whether any sample may train on the empty caption (--caption-dropout, or a dataset's own)."""
    return any(p > 0 for p in [opts.loss.caption_dropout, *caption_dropouts(plan.datasets, 0.0).values()])


def _embeddings(
    opts: TrainOptions,
    world: World,
    plan: TrainPlan,
    validation: ValidationPlan | None,
    device: torch.device,
    precision: str,
) -> Embeddings:
    """The prompts' embeddings and the empty caption's, for validation and --caption-dropout: from the cache, or
    encoded now by the model's text encoders (loaded on every rank, freed after)."""
    captions = list(validation.prompts) if validation is not None else []
    if validation is not None or _drops_captions(opts, plan):
        captions.append(EMPTY_CAPTION)
    if not captions:
        return {}
    from stk.models import load_encoders

    dtype = dtype_of(precision)

    def encoders() -> Any:
        check_text_encoders_in_train(plan.family, "the cache lacks a prompt's embedding (or the empty caption's)")
        log.info(
            "encoding %d prompts with %s's text encoders (stk-cache --validation-prompts stores them)",
            len(captions),
            opts.model,
        )
        return world.run_everywhere(lambda: load_encoders(opts.model, plan.family, device, dtype))

    return embed_captions(captions, plan.data.caption_arrays, encoders)
