"""The step loop: optimizer steps (stk.train.step) until the run is done, a stop signal, a GPU fault or divergence.

Each optimizer step ends at a boundary where every rank agrees (one all-reduce: `stopping.agree`) on whether to
stop for a signal or a GPU fault and whether the step was finite, so ranks never disagree about the step they stop
at. There the hooks, the validator and the checkpointer each decide for themselves whether to act; a non-finite step
is never checkpointed (stk.train.report.divergence).
"""

from __future__ import annotations

import math
import time
from enum import StrEnum

from stk.errors import ExitCode
from stk.failures import is_gpu_error, is_peer_failure
from stk.log import get_logger
from stk.train.data.loader import BatchLoader
from stk.train.report.divergence import weights_finite
from stk.train.report.metrics import peak_gpu_memory
from stk.train.setup import Trainer
from stk.train.step import StepResult, train_step
from stk.train.stopping import Agreement, agree

__all__ = ["Outcome", "train"]

log = get_logger("train")


class Outcome(StrEnum):
    """How a run ended, as the summary line names it."""

    FINISHED = "finished"  # every step trained, the final model exported
    REQUEUE = "requeue"  # stopped by a signal at a checkpoint: requeue the job to continue
    GPU_FAULT = "gpu_fault"  # a rank's GPU failed: the job stops for the node to be drained
    DIVERGED = "diverged"  # steps came out non-finite: stopped with the checkpoints from before, no final model

    @property
    def exit_code(self) -> ExitCode:
        return {
            Outcome.FINISHED: ExitCode.OK,
            Outcome.REQUEUE: ExitCode.REQUEUE,
            Outcome.GPU_FAULT: ExitCode.GPU_FAULT,
            Outcome.DIVERGED: ExitCode.DIVERGED,
        }[self]


def train(run: Trainer) -> Outcome:
    """Steps until done, a stop signal (checkpoint; REQUEUE) or a GPU fault (GPU_FAULT)."""
    run.signals.defer()  # a stop signal now waits for the step boundary, where every rank checkpoints
    while run.step < run.total_steps:
        loader = BatchLoader(run.plan.data, iter(run.sampler), run.opts.loader_threads, run.opts.prefetch)
        try:
            outcome = _epoch(run, loader)
        finally:
            loader.close()
        if outcome is not None:
            return outcome
        run.sampler.set_epoch(run.sampler.epoch + 1)
    return Outcome.FINISHED


def _epoch(run: Trainer, loader: BatchLoader) -> Outcome | None:
    """The steps of the epoch `loader` reads; None when it ends before the run does."""
    batches, trained_in_epoch = iter(loader), run.sampler.step
    while True:
        step_started = time.monotonic()
        dataset = run.sampler.dataset_at(trained_in_epoch)  # every micro-step of the step, on every rank
        try:
            result = train_step(
                run.model,
                batches,
                run.step,
                run.opts.seed,
                run.rank,
                run.sampler.world_size,
                run.opts.grad_accum,
                dataset,
            )
        except Exception as exc:
            if not is_gpu_error(exc) or is_peer_failure(exc):
                raise
            run.watch.report_error(f"{type(exc).__name__} in the training step: {exc}".splitlines()[0])
            return Outcome.GPU_FAULT  # no collective now: the others stop when this process ends
        if result is None:
            return None
        trained_in_epoch += result.micro_batches
        outcome = _step_boundary(run, loader, result, trained_in_epoch, step_started)
        if outcome is not None:
            return outcome


def _step_boundary(
    run: Trainer, loader: BatchLoader, result: StepResult, trained_in_epoch: int, step_started: float
) -> Outcome | None:
    """After optimizer step `run.step + 1`: the hooks, the agreement, a validation round, the metrics row and a
    checkpoint, each when due; the outcome when the run ends here."""
    run.step += 1
    for hook in run.hooks:
        hook.after_step(run.step)
    grad_norm = _grad_norm(run)
    agreed = agree(
        run.signals.received is not None,
        run.watch.fault is not None,
        result.loss,
        result.digest % 2**32,
        run.model.device,
        grad_norm,
    )
    run.loss = agreed.loss if agreed.finite else None
    run.nonfinite.record(run.step, agreed, run.sampler.world_size)
    seconds = time.monotonic() - step_started
    validated = None
    validator = run.validator
    quiet = agreed.stop or agreed.fault or not agreed.finite
    if validator is not None and validator.due(run.step, run.total_steps) and not quiet:
        validated = validator.validate(run.step, run.hooks, run.metrics)
    _record(run, loader, agreed, grad_norm, trained_in_epoch, seconds, validated, result.dataset)
    if agreed.fault:
        return Outcome.GPU_FAULT
    if run.nonfinite.exceeded:
        return _diverged(run, run.nonfinite.too_many())
    if run.checkpointer.due(run.step, run.total_steps, agreed.stop):
        if not agreed.finite:
            run.checkpointer.postponed = True  # to the next finite step
        elif not weights_finite(run.model.engine.module, run.model.device):
            return _diverged(run, "the trained weights are not finite (nan or inf)")
        else:
            run.checkpointer.save(
                run.model.engine,
                run.model.objective,
                run.step,
                run.sampler.state_dict(trained_in_epoch),
                run.nonfinite.total,
            )
    if agreed.stop:
        return Outcome.REQUEUE
    if run.step >= run.total_steps:
        return Outcome.FINISHED if agreed.finite else _diverged(run, "the last step was not finite")
    return None


def _diverged(run: Trainer, why: str) -> Outcome:
    """Stop every rank here (each reached the same verdict): rank 0 says why in one line."""
    if run.rank == 0:
        tag = run.checkpointer.checkpoints.latest()
        checkpoint = None if tag is None else f"{run.checkpointer.checkpoints.path}/{tag}"
        log.error("%s", run.nonfinite.diverged(run.step, why, checkpoint))
    return Outcome.DIVERGED


def _grad_norm(run: Trainer) -> float | None:
    """The step's gradient norm over every rank, where DeepSpeed computed one."""
    norm = run.model.engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _record(
    run: Trainer,
    loader: BatchLoader,
    agreed: Agreement,
    grad_norm: float | None,
    trained_in_epoch: int,
    seconds: float,
    validated: float | None,
    dataset: str,
) -> None:
    """The step's metrics row (a value that is not finite is null: JSON has no nan); with several datasets, the
    dataset its loss is of (every rank drew the step from it), and its samples counted for the summary."""
    row = {
        "step": run.step,
        "epoch": round(run.sampler.epoch + trained_in_epoch / max(len(run.sampler), 1), 4),
        "loss": agreed.loss if math.isfinite(agreed.loss) else None,
        "lr": float(run.model.engine.get_lr()[0]),
        "grad_norm": grad_norm if grad_norm is not None and math.isfinite(grad_norm) else None,
        "nonfinite_steps": run.nonfinite.total,
        "samples_per_s": round(run.sampler.effective_batch / seconds, 3) if seconds > 0 else None,
        "step_time": round(seconds, 4),
        "data_wait": round(loader.take_wait(), 6),
        "time": round(time.time(), 3),
        "batch_digest": f"{agreed.digest:08x}",
    }
    peak = peak_gpu_memory(run.model.device)
    if peak is not None:
        row["peak_gpu_memory"] = peak
    if validated is not None:
        row["sample_seconds"] = validated
    if dataset:
        row["dataset"] = dataset
        run.samples_per_dataset[dataset] = run.samples_per_dataset.get(dataset, 0) + run.sampler.effective_batch
    run.metrics.write(row)
    run.progress.update()
