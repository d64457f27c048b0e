"""The end of a run: the final model exported (by the trainable, after the hooks have had their say) and the
summary line.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stk.log import get_logger
from stk.train.checkpoint.store import Resume
from stk.train.loop import Outcome
from stk.train.report.metrics import peak_gpu_memory
from stk.train.setup import Trainer

__all__ = ["TrainSummary", "export_final", "summary"]

log = get_logger("train")


@dataclass
class TrainSummary:
    output_dir: str
    outcome: Outcome
    steps: int  # optimizer steps done, resumed ones included
    total_steps: int
    resumed_from: str | None
    checkpoint: str | None  # the last one saved by this run
    final: str | None  # the diffusers model, when finished
    loss: float | None  # the last step's, averaged over ranks (None where it was not finite)
    seconds: float
    samples_per_second: float
    peak_gpu_memory: int | None  # bytes, this rank's torch.cuda.max_memory_allocated (None on the CPU)
    ranks: int
    hosts: dict[str, int]  # host name -> ranks it ran: where the job really ran, in its log
    samples_per_dataset: dict[str, int] = field(default_factory=dict)  # trained by this run; {}: one dataset
    nonfinite_steps: int = 0  # steps whose loss or gradient norm was nan or inf, resumed ones included

    def to_dict(self) -> dict[str, Any]:
        """The summary line's fields (samples_per_dataset only where a run has several datasets)."""
        line = {**asdict(self), "outcome": self.outcome.value}
        if not self.samples_per_dataset:
            del line["samples_per_dataset"]
        return line


def export_final(run: Trainer) -> str:
    """OUTPUT/final; each hook first (the EMA writes the raw weights to OUTPUT/final-no-ema and puts its average in
    the module, as diffusers' examples save it)."""
    for hook in run.hooks:
        hook.before_export(lambda name: _export(run, name))
    return _export(run, "final")


def _export(run: Trainer, name: str) -> str:
    """OUTPUT/`name` from the trained weights, as the trainable writes it (the whole pipeline, or the adapter)."""
    import torch.distributed as dist

    out = os.path.join(run.opts.output_dir, name)
    run.trainable.export(run.model.engine, run.model.objective, run.opts.model, out, run.rank)
    if run.rank == 0:
        log.info("final %s: %s", run.trainable.what, out)
    dist.barrier()
    return out


def summary(run: Trainer, outcome: Outcome, final: str | None, resume: Resume | None, started: float) -> TrainSummary:
    seconds = time.monotonic() - started
    trained = (run.step - run.first_step) * run.sampler.effective_batch
    return TrainSummary(
        output_dir=run.opts.output_dir,
        outcome=outcome,
        steps=run.step,
        total_steps=run.total_steps,
        resumed_from=f"{resume.directory}/{resume.tag}" if resume else None,
        checkpoint=run.checkpointer.last_path,
        final=final,
        loss=run.loss,
        seconds=round(seconds, 3),
        samples_per_second=round(trained / seconds, 3) if seconds > 0 else 0.0,
        peak_gpu_memory=peak_gpu_memory(run.model.device),
        ranks=sum(run.hosts.values()),
        hosts=run.hosts,
        samples_per_dataset=dict(sorted(run.samples_per_dataset.items())),
        nonfinite_steps=run.nonfinite.total,
    )
