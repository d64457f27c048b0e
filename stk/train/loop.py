"""The step loop: optimizer steps (stk.train.step) until the run is done, a stop signal or a GPU fault.

Each optimizer step ends at a boundary where every rank agrees (one all-reduce: `stopping.agree`) on whether to
stop for a signal or a GPU fault, so ranks never disagree about the step they stop at. There the hooks, the
validator and the checkpointer each decide for themselves whether to act.
"""

from __future__ import annotations

import math
import time
from enum import StrEnum

from stk.errors import ExitCode
from stk.train.data import BatchLoader
from stk.train.metrics import peak_gpu_memory
from stk.train.setup import Trainer
from stk.train.step import StepResult, train_step
from stk.train.stopping import Agreement, agree, is_gpu_error, is_peer_failure

__all__ = ["Outcome", "train"]


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
                run.model, batches, run.step, run.opts.seed, run.rank, run.sampler.world_size, run.opts.grad_accum,
                dataset,
            )  # fmt: skip
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
    agreed = agree(
        run.signals.received is not None, run.watch.fault is not None, result.loss, result.digest % 2**32,
        run.model.device,
    )  # fmt: skip
    run.loss = agreed.loss
    seconds = time.monotonic() - step_started
    validated = None
    validator = run.validator
    if validator is not None and validator.due(run.step, run.total_steps) and not (agreed.stop or agreed.fault):
        validated = validator.validate(run.step, run.hooks, run.metrics)
    _record(run, loader, agreed, trained_in_epoch, seconds, validated, result.dataset)
    if agreed.fault:
        return Outcome.GPU_FAULT
    if run.checkpointer.due(run.step, run.total_steps, agreed.stop):
        run.checkpointer.save(run.model, run.step, run.sampler.state_dict(trained_in_epoch))
    if agreed.stop:
        return Outcome.REQUEUE
    if run.step >= run.total_steps:
        return Outcome.FINISHED
    return None


def _record(
    run: Trainer, loader: BatchLoader, agreed: Agreement, trained_in_epoch: int, seconds: float,
    validated: float | None, dataset: str,
) -> None:  # fmt: skip
    """The step's metrics row; with several datasets, the dataset its loss is of (every rank drew the step from
    it), and its samples counted for the summary."""
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
