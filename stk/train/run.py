"""One stk-train run on every rank: the guards, then the phases: setup (stk.train.setup), the step loop
(stk.train.loop) and the finish (stk.train.finish).

Nothing heavy happens before the guards pass: the shared output directory and its lease, the GPU layout, the
trainable's settings, the DeepSpeed config, the base precision (stk.train.trainable.baseprecision), the compiler
--compile needs, the checkpoint to resume (verified, fitted to this number of ranks, its settings compared), the data
plan, the loss, reporter and validation options, the LoRA targets and the cache's model, each refused in seconds with
one line.
"""

from __future__ import annotations

import time

import torch

from stk.cluster.lease import Lease, leased
from stk.cluster.world import World
from stk.errors import ExitCode
from stk.failures import is_out_of_memory, is_peer_failure, out_of_memory, peer_failed
from stk.train.checkpoint.checkpointer import fit_world_size, loadable
from stk.train.checkpoint.store import CheckpointDir, Resume
from stk.train.data.cachemodel import check_cache_model, note_latents
from stk.train.data.plan import TrainPlan, plan_training
from stk.train.deepspeed.config import load_deepspeed_config, zero_stage
from stk.train.finish import TrainSummary, export_final, summary
from stk.train.loop import Outcome, train
from stk.train.objective.objectives import objective_for
from stk.train.options import TrainOptions
from stk.train.preflight import check_gpu_layout, check_shared_output
from stk.train.report.reporters import check_reporter
from stk.train.setup import Setting, setup
from stk.train.stopping import StopSignals
from stk.train.trainable.baseprecision import check as check_base
from stk.train.trainable.compiled import check_compiler
from stk.train.trainable.fp8 import check as check_fp8
from stk.train.trainable.kinds import trainable_for
from stk.train.validation.plan import ValidationPlan
from stk.train.validation.validator import planned

__all__ = ["Outcome", "TrainSummary", "run_train"]


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
    trainable = trainable_for(opts)
    deepspeed_config = load_deepspeed_config(opts.deepspeed)
    world.run_everywhere(lambda: check_base(opts.base_precision, trainable.frozen_base, zero_stage(deepspeed_config)))
    world.run_everywhere(lambda: check_fp8(opts.fp8_matmuls, opts.base_precision))
    world.run_everywhere(lambda: check_compiler(opts.compile_mode))
    checkpoints = CheckpointDir(opts.output_dir, opts.keep_checkpoints, world.rank, trainable.frozen_base)
    resume = checkpoints.resolve(opts.resume, world)  # the newest checkpoint that verifies
    saved_world = None
    if resume is not None:
        opts, saved_world = fit_world_size(opts, world, checkpoints, resume)
    plan = world.run_everywhere(lambda: plan_training(opts, world.size))
    validation, overridden = _checked(opts, world, plan, checkpoints, resume)
    try:
        world.root_call(lambda: trainable.check(objective_for(plan.family, opts.model)))
        world.root_call(lambda: check_cache_model(opts, plan))
        world.root_call(lambda: note_latents(opts, plan))
        loading = None if resume is None else loadable(resume, saved_world, world, deepspeed_config)
        setting = Setting(opts, plan, validation, deepspeed_config, trainable, checkpoints, loading, overridden)
        return _phases(setting, world, signals, started)
    finally:
        plan.data.close()
        _end_distributed()


def _checked(
    opts: TrainOptions, world: World, plan: TrainPlan, checkpoints: CheckpointDir, resume: Resume | None
) -> tuple[ValidationPlan | None, list[str]]:
    """The options the plan settles, refused once, by rank 0, before any model loads: the validation plan, and the
    settings that differ from the checkpoint's (--override-resume)."""
    world.run_everywhere(lambda: opts.loss.check(plan.family))
    world.run_everywhere(lambda: check_reporter(opts.report_to))
    validation = world.run_everywhere(lambda: planned(opts, plan))
    overridden: list[str] = []
    if resume is not None:
        settings = plan.run_settings(opts, world.size)
        overridden = world.root_call(lambda: checkpoints.check_settings(resume, settings, opts.override_resume))
    return validation, overridden


def _end_distributed() -> None:
    """Tear the process group down before the interpreter exits: gloo's threads still running at
    exit end the process with `terminate called without an active exception` (SIGABRT)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _phases(setting: Setting, world: World, signals: StopSignals, started: float) -> tuple[TrainSummary, ExitCode]:
    """Setup, the baseline validation round, the step loop, and on success the export; the summary."""
    run = setup(setting, world, signals)
    run.metrics.start(run.step)
    run.watch.start()
    try:
        if run.validator is not None:
            run.validator.baseline(run.step, run.hooks, run.metrics)
        outcome = train(run)
    finally:
        run.watch.stop()
        run.metrics.close()
        run.progress.close()
    final = export_final(run) if outcome is Outcome.FINISHED else None
    return summary(run, outcome, final, setting.resume, started), outcome.exit_code
