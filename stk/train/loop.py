"""One stk-train run on every rank: preflight, models, engine, resume, the step loop with its stop
agreement and checkpoints, and the final diffusers model.

Nothing heavy happens before the preflight checks pass. Each optimizer step ends at a boundary
where every rank agrees (one all-reduce) on whether to stop for a signal or a GPU fault, so ranks
never disagree about the step they stop at.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from stk.errors import ExitCode, InputError
from stk.health.breaker import GpuWatch
from stk.lease import Lease, leased
from stk.log import get_logger
from stk.progress import Progress
from stk.prompts import EMPTY_CAPTION
from stk.train.batch import Batch, StepInputs
from stk.train.cachemodel import check_cache_model
from stk.train.checkpoint import CheckpointDir, Resume
from stk.train.data import BatchLoader
from stk.train.distributed import DistEnv, init_distributed, resolve_dist_env
from stk.train.dsconfig import load_deepspeed_config, zero_stage
from stk.train.ema import ShardedEma
from stk.train.embeddings import Embeddings, embed_captions
from stk.train.engine import build_engine, engine_config, full_state_dict
from stk.train.export import export_pipeline
from stk.train.lora import add_lora, check_targets, lora_state_dict, save_lora
from stk.train.losses import drop_captions
from stk.train.metrics import MetricsLog
from stk.train.objectives import Objective, objective_for
from stk.train.optim import apply_optimizer_settings
from stk.train.options import TrainOptions
from stk.train.plan import TrainPlan, plan_training
from stk.train.preflight import check_gpu_layout, check_shared_output
from stk.train.render import SAMPLES_DIR, SampleRenderer, write_round
from stk.train.reporters import check_reporter
from stk.train.sampler import BucketSampler
from stk.train.samples import SamplePlan, plan_samples
from stk.train.stopping import (
    Agreement,
    StopSignals,
    agree,
    is_gpu_error,
    is_out_of_memory,
    is_peer_failure,
    out_of_memory,
    peer_failed,
)
from stk.train.worldsize import accumulation_for, universal_checkpoint
from stk.world import World

__all__ = ["Outcome", "TrainSummary", "run_train"]

log = get_logger("train")


class Outcome(StrEnum):
    """How a run ended, as the summary line names it."""

    FINISHED = "finished"  # every step trained, the final model exported
    REQUEUE = "requeue"  # stopped by a signal at a checkpoint: requeue the job to continue
    GPU_FAULT = "gpu_fault"  # a rank's GPU failed: the job stops for the node to be drained

    @property
    def exit_code(self) -> ExitCode:
        return {
            Outcome.FINISHED: ExitCode.OK,
            Outcome.REQUEUE: ExitCode.REQUEUE,
            Outcome.GPU_FAULT: ExitCode.GPU_FAULT,
        }[self]


@dataclass
class TrainSummary:
    output_dir: str
    outcome: Outcome
    steps: int  # optimizer steps done, resumed ones included
    total_steps: int
    resumed_from: str | None
    checkpoint: str | None  # the last one saved by this run
    final: str | None  # the diffusers model, when finished
    loss: float | None  # the last step's, averaged over ranks
    seconds: float
    samples_per_second: float
    peak_gpu_memory: int | None  # bytes, this rank's torch.cuda.max_memory_allocated (None on the CPU)
    ranks: int
    hosts: dict[str, int]  # host name -> ranks it ran: where the job really ran, in its log

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome.value}


@dataclass
class _Model:
    """What a micro-step runs: the objective on the engine, inputs moved to the device and dtype."""

    objective: Objective
    engine: Any
    encoders: Any  # stk.models.Encoders with --vae-on-the-fly, else None
    device: torch.device
    dtype: torch.dtype


@dataclass
class _Run:
    """The step loop's state: set up once, advanced by each optimizer step."""

    opts: TrainOptions
    plan: TrainPlan
    sampler: BucketSampler
    model: _Model
    rank: int
    checkpoints: CheckpointDir
    metrics: MetricsLog
    signals: StopSignals
    watch: GpuWatch
    progress: Progress
    total_steps: int
    first_step: int
    step: int
    ema: ShardedEma | None = None
    renderer: SampleRenderer | None = None
    empty_caption: dict[str, torch.Tensor] | None = None  # its embedding, with --caption-dropout
    hosts: dict[str, int] = field(default_factory=dict)  # host -> ranks on it
    last_checkpoint: str | None = None
    loss: float | None = None


def run_train(opts: TrainOptions, world: World) -> tuple[TrainSummary, ExitCode]:
    """Train on every rank of `world` and return the summary with the exit code its outcome asks for.

    Every check that needs no model runs first, so a job that cannot work fails in seconds; a stop
    signal or a GPU fault ends the run at a step boundary all ranks agree on (a stop signal before the
    first step ends it at once), and a peer that fails or stops answering is reported as an
    infrastructure error (rerun, maybe elsewhere)."""
    started = time.monotonic()
    signals = StopSignals().install()  # from the start: a signal before the first step ends the run at once
    try:
        return _prepared_run(opts, world, signals, started)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise out_of_memory(exc, opts.batch_size) from None
        if not is_peer_failure(exc):
            raise
        raise peer_failed(exc, world.rank, world.node, opts.collective_timeout) from exc
    finally:
        signals.restore()


def _prepared_run(
    opts: TrainOptions, world: World, signals: StopSignals, started: float
) -> tuple[TrainSummary, ExitCode]:
    check_shared_output(world, opts.output_dir)
    with leased(Lease(opts.output_dir, "stk-train", "--output-dir"), world):  # before anything is written there
        return _leased_run(opts, world, signals, started)


def _leased_run(
    opts: TrainOptions, world: World, signals: StopSignals, started: float
) -> tuple[TrainSummary, ExitCode]:
    check_gpu_layout(world, torch.cuda.device_count())
    opts.lora.check()
    deepspeed_config = load_deepspeed_config(opts.deepspeed)
    checkpoints = CheckpointDir(opts.output_dir, opts.keep_checkpoints, world.rank, frozen_base=opts.lora.enabled)
    resume = checkpoints.resolve(opts.resume, world)  # the newest checkpoint that verifies
    saved_world = None
    if resume is not None:
        opts, saved_world = _fit_world_size(opts, world, checkpoints, resume)
    plan = world.run_everywhere(lambda: plan_training(opts, world.size))
    world.run_everywhere(lambda: opts.loss.check(plan.family))  # refused once, by rank 0, before any model loads
    world.run_everywhere(lambda: check_reporter(opts.report_to))
    samples = world.run_everywhere(lambda: _plan_samples(opts, plan))
    overridden: list[str] = []
    if resume is not None:
        settings = opts.run_settings(plan.family, world.size)
        overridden = world.root_call(lambda: checkpoints.check_settings(resume, settings, opts.override_resume))
    try:
        world.root_call(lambda: check_targets(opts.lora, objective_for(plan.family, opts.model)))
        world.root_call(lambda: check_cache_model(opts, plan))
        loading = resume
        if resume is not None and saved_world not in (None, world.size) and zero_stage(deepspeed_config):
            folder = os.path.join(resume.directory, resume.tag)
            world.root_call(lambda: universal_checkpoint(folder))  # the others wait: no process group yet
            loading = replace(resume, universal=True)
        return _run(opts, world, plan, samples, deepspeed_config, checkpoints, (loading, overridden), signals, started)
    finally:
        plan.data.close()
        _end_distributed()


def _fit_world_size(
    opts: TrainOptions, world: World, checkpoints: CheckpointDir, resume: Resume
) -> tuple[TrainOptions, int | None]:
    """`opts` with the gradient accumulation that keeps the checkpoint's effective batch on this run's ranks, and
    the number of ranks the checkpoint was saved on (None where it was not recorded)."""
    saved = world.root_call(lambda: checkpoints.saved_settings(resume))
    where = f"{resume.directory}/{resume.tag}"
    accum = world.root_call(
        lambda: accumulation_for(saved, opts.batch_size, opts.grad_accum, world.size, where, opts.override_resume)
    )
    return replace(opts, grad_accum=accum), saved.get("world_size")


def _plan_samples(opts: TrainOptions, plan: TrainPlan) -> SamplePlan | None:
    """The samples to make (stk.train.samples), the most common bucket weighed by its repeats."""
    sizes = {hw: len(keys) * plan.repeats.get(hw, 1) for hw, keys in plan.buckets.items()}
    return plan_samples(opts.samples, plan.family, plan.data.validation_prompts, sizes, plan.vae_scale_factor)


def _end_distributed() -> None:
    """Tear the process group down before the interpreter exits: gloo's threads still running at
    exit end the process with `terminate called without an active exception` (SIGABRT)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run(
    opts: TrainOptions,
    world: World,
    plan: TrainPlan,
    samples: SamplePlan | None,
    deepspeed_config: dict[str, Any],
    checkpoints: CheckpointDir,
    resuming: tuple[Resume | None, list[str]],
    signals: StopSignals,
    started: float,
) -> tuple[TrainSummary, ExitCode]:
    run = _setup(opts, world, plan, samples, deepspeed_config, checkpoints, resuming, signals)
    run.metrics.start(run.step)
    run.watch.start()
    try:
        if run.renderer is not None and run.step == 0:  # the baseline, before the first step
            seconds = _sample(run)
            if seconds is not None:
                run.metrics.write({"step": 0, "sample_seconds": seconds, "time": round(time.time(), 3)})
        outcome = _train(run)
    finally:
        run.watch.stop()
        run.metrics.close()
        run.progress.close()
    final = _export_all(run) if outcome is Outcome.FINISHED else None
    return _summary(run, outcome, final, resuming[0], started), outcome.exit_code


def _start_distributed(opts: TrainOptions, world: World) -> tuple[DistEnv, torch.device, str]:
    """The process group, this rank's device and the precision it trains in."""
    env = resolve_dist_env(world, os.environ)
    init_distributed(env, timeout=datetime.timedelta(seconds=opts.collective_timeout))
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return env, device, opts.precision or ("bf16" if device.type == "cuda" else "fp32")


def _dtype(precision: str) -> torch.dtype:
    """The dtype the denoiser (and whatever runs beside it) computes in."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _sampler(opts: TrainOptions, plan: TrainPlan, env: DistEnv) -> tuple[BucketSampler, int]:
    """This rank's sampler and the optimizer steps to train."""
    sampler = BucketSampler(
        plan.buckets, plan.repeats, opts.batch_size, env.world_size, env.rank, opts.grad_accum, opts.seed
    )
    if not sampler.steps_per_epoch:
        raise InputError("no bucket fills one effective batch: nothing to train (see the bucket check above)")
    # --max-steps wins over --epochs either way, as every peer's max_train_steps does: the epochs follow from it
    total_steps = opts.max_steps or sampler.steps_per_epoch * opts.epochs
    log.info(
        "%s: %d samples in %d buckets, %d optimizer steps per epoch of %d samples each; training %d steps",
        plan.family.value,
        sum(len(k) for k in plan.buckets.values()),
        len(plan.buckets),
        sampler.steps_per_epoch,
        sampler.effective_batch,
        total_steps,
    )
    return sampler, total_steps


def _load_model(
    opts: TrainOptions, world: World, plan: TrainPlan, device: torch.device, precision: str,
    deepspeed_config: dict[str, Any], total_steps: int, load_universal: bool,
) -> _Model:  # fmt: skip
    """The denoiser in its DeepSpeed engine (and the encoders, with --vae-on-the-fly); `load_universal` for a
    checkpoint saved on another number of ranks."""
    dtype = _dtype(precision)
    objective = objective_for(plan.family, opts.model, opts.guidance_scale, opts.loss)
    config = engine_config(opts, deepspeed_config, precision, load_universal)
    zero3 = config if zero_stage(config) == 3 else None  # built partitioned: no rank ever holds the whole model
    denoiser = world.run_everywhere(lambda: objective.load_denoiser(dtype, world, zero3))
    if opts.lora.enabled:
        layers = add_lora(denoiser, opts.lora, plan.family, opts.seed)
        log.info("LoRA of rank %d (alpha %d) on %d layers; the base weights frozen", opts.lora.rank,
                 opts.lora.scale_alpha, layers)  # fmt: skip
    denoiser = denoiser.to(device)
    encoders = None
    if opts.vae_on_the_fly:
        from stk.models import load_encoders

        encoders = world.run_everywhere(lambda: load_encoders(opts.model, plan.family, device, dtype))
    engine = build_engine(denoiser, opts, config, precision, total_steps)
    return _Model(objective, engine, encoders, device, dtype)


def _setup(
    opts: TrainOptions, world: World, plan: TrainPlan, samples: SamplePlan | None, deepspeed_config: dict[str, Any],
    checkpoints: CheckpointDir, resuming: tuple[Resume | None, list[str]], signals: StopSignals,
) -> _Run:  # fmt: skip
    """Everything the step loop needs, the checkpoint resumed from loaded."""
    resume, overridden = resuming
    env, device, precision = _start_distributed(opts, world)
    sampler, total_steps = _sampler(opts, plan, env)
    embeddings = _embeddings(opts, world, plan, samples, device, precision)  # before the denoiser: encoders freed
    universal = resume is not None and resume.universal
    model = _load_model(opts, world, plan, device, precision, deepspeed_config, total_steps, universal)
    step = _resume(model.engine, sampler, checkpoints, resume, opts, overridden) if resume is not None else 0
    ema = None
    if opts.ema_decay:
        ema = ShardedEma(model.engine.module, opts.ema_decay, opts.ema_every, env.rank, env.world_size)
        if resume is not None:
            ema.load(os.path.join(resume.directory, resume.tag))
        log.info("EMA (decay %g) of %d trained weights, %d on this rank", opts.ema_decay, ema.total, len(ema.shadow))
    watch = GpuWatch(
        None, interval=opts.health_interval, notify_urls=opts.notify_urls, notify_config=opts.notify_config,
        rank=env.rank,
    )  # fmt: skip
    metrics = MetricsLog(opts.output_dir, env.rank == 0, opts.report_to)
    renderer = None
    if samples is not None:
        module = model.engine.module
        renderer = SampleRenderer(samples, model.objective, module, embeddings, device, model.dtype, env.rank,
                                  env.world_size)  # fmt: skip
        log.info("samples of %d prompts at %dx%d, %d steps: at step 0, every %d steps and at the end (%s/)",
                 len(samples.prompts), samples.width, samples.height, samples.steps, samples.every,
                 os.path.join(opts.output_dir, SAMPLES_DIR))  # fmt: skip
    return _Run(
        opts, plan, sampler, model, env.rank, checkpoints, metrics, signals, watch,
        Progress(world, total_steps - step, "steps", "train"), total_steps, first_step=step, step=step, ema=ema,
        renderer=renderer, empty_caption=embeddings.get(EMPTY_CAPTION) if opts.loss.caption_dropout else None,
        hosts=dict(sorted(Counter(world.allgather(world.node)).items())),
    )  # fmt: skip


def _embeddings(
    opts: TrainOptions, world: World, plan: TrainPlan, samples: SamplePlan | None, device: torch.device,
    precision: str,
) -> Embeddings:  # fmt: skip
    """The prompts' embeddings and the empty caption's, for samples and --caption-dropout: from the cache, or
    encoded now by the model's text encoders (loaded on every rank, freed after)."""
    captions = list(samples.prompts) if samples is not None else []
    if samples is not None or opts.loss.caption_dropout:
        captions.append(EMPTY_CAPTION)
    if not captions:
        return {}
    from stk.models import load_encoders

    dtype = _dtype(precision)

    def encoders() -> Any:
        log.info("encoding %d prompts with %s's text encoders (stk-cache --validation-prompts stores them)",
                 len(captions), opts.model)  # fmt: skip
        return world.run_everywhere(lambda: load_encoders(opts.model, plan.family, device, dtype))

    return embed_captions(captions, plan.data.caption_arrays, encoders)


def _summary(run: _Run, outcome: Outcome, final: str | None, resume: Resume | None, started: float) -> TrainSummary:
    seconds = time.monotonic() - started
    trained = (run.step - run.first_step) * run.sampler.effective_batch
    return TrainSummary(
        output_dir=run.opts.output_dir,
        outcome=outcome,
        steps=run.step,
        total_steps=run.total_steps,
        resumed_from=f"{resume.directory}/{resume.tag}" if resume else None,
        checkpoint=os.path.join(run.checkpoints.path, run.last_checkpoint) if run.last_checkpoint else None,
        final=final,
        loss=run.loss,
        seconds=round(seconds, 3),
        samples_per_second=round(trained / seconds, 3) if seconds > 0 else 0.0,
        peak_gpu_memory=_peak_gpu_memory(run.model.device),
        ranks=sum(run.hosts.values()),
        hosts=run.hosts,
    )


def _resume(
    engine: Any, sampler: BucketSampler, checkpoints: CheckpointDir, resume: Resume, opts: TrainOptions,
    overridden: list[str],
) -> int:  # fmt: skip
    """Load the checkpoint and return its step. With settings overridden (--override-resume) this
    run's optimizer settings and schedule replace the checkpoint's, and a sample order that no
    longer matches starts its epoch over."""
    where = f"{resume.directory}/{resume.tag}"
    state = checkpoints.load(engine, resume, keep_schedule=not overridden)
    step = int(state["step"])
    try:
        sampler.load_state_dict(state["sampler"])
    except ValueError as exc:
        if not overridden:
            raise InputError(f"{where}: {exc}; use another --output-dir") from None
        log.warning("%s: %s; the sample order starts epoch %d over", where, exc, state["sampler"]["epoch"])
        sampler.set_epoch(int(state["sampler"]["epoch"]))
    if overridden:
        apply_optimizer_settings(engine.optimizer, opts.optimizer, engine.lr_scheduler, step)
    log.info("resumed from %s at step %d", where, step)
    return step


def _train(run: _Run) -> Outcome:
    """Steps until done, a stop signal (checkpoint; REQUEUE) or a GPU fault (GPU_FAULT)."""
    run.signals.defer()  # a stop signal now waits for the step boundary, where every rank checkpoints
    accum = run.opts.grad_accum
    while run.step < run.total_steps:
        trained_in_epoch = run.sampler.step
        loader = BatchLoader(run.plan.data, iter(run.sampler), run.opts.loader_threads, run.opts.prefetch)
        micro, loss_sum, digest, step_started = 0, 0.0, 0, time.monotonic()
        try:
            for batch in loader:
                slot = micro * run.sampler.world_size + run.rank  # this micro-batch's place in the optimizer step
                generator = _generator(run.opts.seed, run.step, slot)
                try:
                    loss = run.model.objective.loss(run.model.engine, _inputs(batch, run, generator), generator)
                    run.model.engine.backward(loss)
                    run.model.engine.step()
                    loss_sum += float(loss.detach())
                    digest += _batch_digest(slot, batch.keys)
                except Exception as exc:
                    if not is_gpu_error(exc) or is_peer_failure(exc):
                        raise
                    run.watch.report_error(f"{type(exc).__name__} in the training step: {exc}".splitlines()[0])
                    return Outcome.GPU_FAULT  # no collective now: the others stop when this process ends
                micro += 1
                trained_in_epoch += 1
                if micro < accum:
                    continue
                run.step += 1
                if run.ema is not None:
                    run.ema.update(run.step)
                agreed = agree(
                    run.signals.received is not None, run.watch.fault is not None, loss_sum / accum, digest % 2**32,
                    run.model.device,
                )  # fmt: skip
                run.loss = agreed.loss
                seconds = time.monotonic() - step_started
                sampled = None
                due = run.renderer is not None and run.renderer.plan.due(run.step, run.total_steps)
                if due and not (agreed.stop or agreed.fault):
                    sampled = _sample(run)
                _record(run, loader, agreed, trained_in_epoch, seconds, sampled)
                if agreed.fault:
                    return Outcome.GPU_FAULT
                position = run.sampler.state_dict(trained_in_epoch)
                every = run.opts.checkpoint_every
                if agreed.stop or (every and run.step % every == 0) or run.step >= run.total_steps:
                    run.last_checkpoint = run.checkpoints.save(
                        run.model.engine,
                        run.step,
                        _client_state(run, position),
                        run.opts.run_settings(run.plan.family, run.sampler.world_size),
                        also=lambda folder: _beside_checkpoint(run, folder),
                    )
                if agreed.stop:
                    return Outcome.REQUEUE
                if run.step >= run.total_steps:
                    return Outcome.FINISHED
                micro, loss_sum, digest, step_started = 0, 0.0, 0, time.monotonic()
        finally:
            loader.close()
        run.sampler.set_epoch(run.sampler.epoch + 1)
    return Outcome.FINISHED


def _generator(seed: int, step: int, slot: int) -> torch.Generator:
    """The noise, timesteps and latent samples of one micro-batch: a pure function of the seed, the optimizer step
    and the micro-batch's place in it (micro-step x ranks + rank, the order the sampler cuts the step in), so a
    resumed run draws exactly what an uninterrupted one would, on any number of ranks that keeps the batch size."""
    digest = hashlib.sha256(f"stk-train:{seed}:{step}:{slot}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _batch_digest(slot: int, keys: list[str]) -> int:
    """32 bits of a micro-batch's sample keys and its place in the optimizer step; summed over the step's
    micro-batches (agree), metrics.jsonl's `batch_digest` shows that a resumed run, on any number of ranks, trained
    each step on what an uninterrupted one did."""
    return int.from_bytes(hashlib.sha256(f"{slot}:{chr(0).join(keys)}".encode()).digest()[:4], "little")


def _inputs(batch: Batch, run: _Run, generator: torch.Generator) -> StepInputs:
    """Latents sampled and normalised for the denoiser, from cached ones or encoded now."""
    model = run.model
    if batch.pixels is not None:
        assert model.encoders is not None and batch.captions is not None
        mean, logvar = model.encoders.encode_images(batch.pixels)
        embeds = model.encoders.encode_text(batch.captions)
        text = {name: torch.from_numpy(np.stack([e.arrays[name] for e in embeds])) for name in embeds[0].arrays}
    else:
        assert batch.mean is not None and batch.text is not None
        mean, logvar, text = batch.mean, batch.logvar, batch.text
    latent = mean
    if logvar is not None:  # a fresh sample of the latent distribution each time the image is seen
        latent = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=generator)
    if run.empty_caption is not None:
        text = drop_captions(text, run.empty_caption, run.opts.loss.caption_dropout, generator)
    return StepInputs(
        latents=run.plan.norm.normalize(latent).to(model.device, model.dtype),
        text={name: value.to(model.device, model.dtype) for name, value in text.items()},
        original_size=batch.original_size.to(model.device),
        crop_top_left=batch.crop_top_left.to(model.device),
    )


def _record(
    run: _Run, loader: BatchLoader, agreed: Agreement, trained_in_epoch: int, seconds: float, sampled: float | None
) -> None:
    grad_norm = run.model.engine.get_global_grad_norm()
    row = {
        "step": run.step,
        "epoch": round(run.sampler.epoch + trained_in_epoch / max(len(run.sampler), 1), 4),
        "loss": agreed.loss,
        "lr": float(run.model.engine.get_lr()[0]),
        "grad_norm": None if grad_norm is None or not math.isfinite(float(grad_norm)) else float(grad_norm),
        "samples_per_s": round(run.sampler.effective_batch / seconds, 3) if seconds > 0 else None,
        "step_time": round(seconds, 4),
        "data_wait": round(loader.take_wait(), 6),
        "time": round(time.time(), 3),
        "batch_digest": f"{agreed.digest:08x}",
    }
    peak = _peak_gpu_memory(run.model.device)
    if peak is not None:
        row["peak_gpu_memory"] = peak
    if sampled is not None:
        row["sample_seconds"] = sampled
    run.metrics.write(row)
    run.progress.update()


def _sample(run: _Run) -> float | None:
    """A round of samples after step `run.step` on every rank; rank 0 writes them and returns the round's seconds
    (None elsewhere). A failed round is a warning: it never stops training."""
    assert run.renderer is not None
    result = run.renderer.render(run.ema)
    if result is None:
        return None
    prompts = run.renderer.plan.prompts
    if result.failures:
        kept = f"{len(result.pngs)} of {len(prompts)} written" if result.pngs else "none written"
        log.warning("samples at step %d: %s (%s); training goes on", run.step, "; ".join(result.failures), kept)
    if result.pngs:
        try:
            run.metrics.images(run.step, write_round(run.opts.output_dir, run.step, prompts, result.pngs))
        except Exception as exc:
            log.warning("samples at step %d not written: %s; training goes on", run.step, str(exc).splitlines()[0])
    return round(result.seconds, 3)


def _peak_gpu_memory(device: torch.device) -> int | None:
    """Bytes: the most this rank's GPU has held in tensors so far (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _client_state(run: _Run, position: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed saves beside the weights: the step and the sampler's trained position."""
    return {"stk": {"step": run.step, "sampler": position, "seed": run.opts.seed, "family": run.plan.family.value}}


def _beside_checkpoint(run: _Run, folder: str) -> list[str]:
    """What a checkpoint holds besides DeepSpeed's files, on every rank: this rank's EMA share, and for a LoRA run
    the adapter in lora/, to try mid-run. Returns the files this rank wrote."""
    written = []
    if run.ema is not None:
        written.append(run.ema.save(folder))
    if run.opts.lora.enabled:
        out = os.path.join(folder, "lora")
        if _save_lora(run, out):
            written += [os.path.join(out, name) for name in sorted(os.listdir(out))]
    return written


def _save_lora(run: _Run, out: str) -> bool:
    """The adapter as `pipe.load_lora_weights(out)` reads it; whether this rank wrote it. Collective: every rank
    gathers, rank 0 writes."""
    state = lora_state_dict(run.model.engine)
    if run.rank == 0:
        assert state is not None
        objective, module = run.model.objective, run.model.engine.module
        save_lora(objective.pipeline_class, objective.denoiser_subfolder, module.peft_config["default"], state, out)
    return run.rank == 0


def _export_all(run: _Run) -> str:
    """OUTPUT/final; with EMA, the raw weights in OUTPUT/final-no-ema first and the average in final/ (as diffusers'
    examples save it)."""
    if run.ema is not None:
        _export(run, "final-no-ema")
        run.ema.apply()
    return _export(run, "final")


def _export(run: _Run, name: str) -> str:
    """OUTPUT/`name`: the adapter of a LoRA run, else the trained denoiser with the source model's other components."""
    import torch.distributed as dist

    out = os.path.join(run.opts.output_dir, name)
    if run.opts.lora.enabled:
        _save_lora(run, out)
    else:
        _save_pipeline(run, out)
    if run.rank == 0:
        log.info("final %s: %s", "LoRA" if run.opts.lora.enabled else "model", out)
    dist.barrier()
    return out


def _save_pipeline(run: _Run, out: str) -> None:
    """The source pipeline with the trained denoiser. Collective: under ZeRO-3 every rank gathers, rank 0 writes."""
    state = full_state_dict(run.model.engine)
    if run.rank == 0:
        assert state is not None
        module = run.model.engine.module
        export_pipeline(
            run.opts.model, run.model.objective.denoiser_subfolder, type(module), dict(module.config), state, out
        )
