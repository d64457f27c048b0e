"""Steps that come out non-finite (a loss or gradient norm of nan or inf) and a run that diverges.

A learning rate too high for the model makes the loss nan within a few steps; DeepSpeed then skips each update
("OVERFLOW! Skipping step") and would go on doing so to the end, while checkpoints of the broken run rotate the good
ones away. Here every rank learns at the step boundary (`stopping.agree`) whether the step was finite; a non-finite
step is one warning line naming the step and the rank, is counted (metrics.jsonl's `nonfinite_steps`) and is never
checkpointed; more than --max-nonfinite-steps of them in a row, non-finite weights at a checkpoint, or a run that would
end on a non-finite step stop every rank at that same step with the DIVERGED outcome (exit 8), the checkpoints from
before it kept and no final/ written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stk.log import get_logger
from stk.train.stopping import Agreement

__all__ = ["NonFiniteSteps", "weights_finite"]

log = get_logger("train")


@dataclass
class NonFiniteSteps:
    """The run's count of non-finite steps (kept in each checkpoint) and the ones in a row now."""

    limit: int  # --max-nonfinite-steps: one more in a row stops the run
    rank: int  # rank 0 says what happened, once for the job
    total: int = 0
    in_a_row: int = 0
    first: str = ""  # what the first step of the current run of them saw, for the line that stops the run

    def record(self, step: int, agreed: Agreement, world_size: int) -> None:
        """Optimizer step `step`, as every rank agreed it came out."""
        if agreed.finite:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        seen = f"step {step}: {_what(agreed, world_size)}"
        if self.in_a_row == 1:
            self.first = seen
        if self.rank == 0:
            log.warning(
                "%s; not checkpointed; %d such step(s) in a row, more than --max-nonfinite-steps %d stop the run",
                seen,
                self.in_a_row,
                self.limit,
            )

    @property
    def exceeded(self) -> bool:
        return self.in_a_row > self.limit

    def diverged(self, step: int, why: str, checkpoint: str | None) -> str:
        """The one line of a run stopped at `step` because of `why`, naming the checkpoint left to go back to."""
        first = f" (the first: {self.first})" if self.in_a_row else ""
        if checkpoint is None:
            back = "no checkpoint was saved before it: rerun with a lower --lr"
        else:
            back = (
                f"the newest checkpoint, {checkpoint}, is from before it: resume from it with a lower --lr "
                f"(--resume-from {checkpoint} --override-resume), or start over with --resume none"
            )
        return f"training diverged at step {step}: {why}{first}; nothing from it was saved; {back}"

    def too_many(self) -> str:
        return f"{self.in_a_row} steps in a row were not finite, more than --max-nonfinite-steps {self.limit}"


def _what(agreed: Agreement, world_size: int) -> str:
    """What was not finite in a step: "the loss on rank 1 (1 of 2 ranks) and the gradient norm"."""
    parts = []
    if agreed.nonfinite_ranks:
        of = f"{agreed.nonfinite_ranks} of {world_size} ranks"
        parts.append(f"the loss on rank {agreed.first_nonfinite} ({of})")
    if agreed.grad_norm_nonfinite:
        parts.append("the gradient norm")
    return " and ".join(parts) + " not finite (nan or inf)"


def weights_finite(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether every trained weight of every rank is finite (collective). Each rank looks at what it holds: the whole
    module, or under ZeRO-3 its partition of each weight (`ds_tensor`); the frozen ones cannot have changed."""
    import torch.distributed as dist

    checks = [torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in module.parameters() if p.requires_grad]
    finite = torch.stack(checks).all() if checks else torch.tensor(True)  # one device sync, not one per weight
    flag = (~finite).to(device, torch.float64).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return not flag.item()
