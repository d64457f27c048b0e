"""The step loop's checkpointer: when to save, what a checkpoint holds besides DeepSpeed's files, and how a run
resumes from one (on this number of ranks or another). The files, their digests and `latest` are
stk.train.checkpoint.store's `CheckpointDir`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from stk.cluster.world import World
from stk.errors import InputError
from stk.log import get_logger
from stk.models import Family
from stk.train.checkpoint.store import CheckpointDir, Resume
from stk.train.checkpoint.worldsize import accumulation_for, universal_checkpoint
from stk.train.data.sampler import BucketSampler
from stk.train.deepspeed.config import zero_stage
from stk.train.deepspeed.optim import apply_optimizer_settings
from stk.train.hooks import TrainHook
from stk.train.objective.objectives import Objective
from stk.train.options import TrainOptions
from stk.train.trainable.kinds import Trainable

__all__ = ["Checkpointer", "fit_world_size", "loadable"]

log = get_logger("train")

NONFINITE = "nonfinite_steps"  # the client state's count of the run's non-finite steps


def fit_world_size(
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


def loadable(resume: Resume, saved_world: int | None, world: World, deepspeed_config: dict[str, Any]) -> Resume:
    """`resume` as this run loads it: saved on another number of ranks under ZeRO, from its universal form, which
    rank 0 makes here (the others wait: no process group yet)."""
    if saved_world in (None, world.size) or not zero_stage(deepspeed_config):
        return resume
    folder = os.path.join(resume.directory, resume.tag)
    world.root_call(lambda: universal_checkpoint(folder))
    return replace(resume, universal=True)


@dataclass
class Checkpointer:
    """Saves at every `every`-th step, on a stop and at the last step, on every rank (a collective); `last` is the
    newest tag this run saved. A save the loop `postponed` (a non-finite step) is due at the next step."""

    checkpoints: CheckpointDir
    every: int  # --checkpoint-every; 0: only on a stop and at the end
    settings: dict[str, Any]  # TrainOptions.run_settings, recorded in each checkpoint's stk-run.json
    seed: int
    family: Family
    trainable: Trainable
    hooks: list[TrainHook] = field(default_factory=list)
    last: str | None = None
    postponed: bool = False

    def due(self, step: int, last_step: int, stop: bool) -> bool:
        return stop or self.postponed or bool(self.every and step % self.every == 0) or step >= last_step

    def save(
        self, engine: Any, objective: Objective, step: int, position: dict[str, Any], nonfinite_steps: int
    ) -> None:
        """Checkpoint optimizer step `step`, with the sampler's trained `position` and the run's count of
        non-finite steps so far."""
        client_state = {
            "stk": {
                "step": step,
                "sampler": position,
                "seed": self.seed,
                "family": self.family.value,
                NONFINITE: nonfinite_steps,
            }
        }
        self.last = self.checkpoints.save(
            engine, step, client_state, self.settings, also=lambda folder: self._beside(engine, objective, folder)
        )
        self.postponed = False

    def _beside(self, engine: Any, objective: Objective, folder: str) -> list[str]:
        """What a checkpoint holds besides DeepSpeed's files, on every rank: each hook's part (this rank's EMA
        share) and the trainable's (a LoRA's adapter in lora/, to try mid-run). Returns the files this rank wrote."""
        written = [path for hook in self.hooks for path in hook.save(folder)]
        rank = self.checkpoints.rank
        return written + self.trainable.save_beside(engine, objective, folder, rank)

    @property
    def last_path(self) -> str | None:
        return os.path.join(self.checkpoints.path, self.last) if self.last else None

    def resume(
        self, engine: Any, sampler: BucketSampler, resume: Resume, opts: TrainOptions, overridden: list[str]
    ) -> tuple[int, int]:
        """Load the checkpoint and return its step and the run's non-finite steps by then (0 in a checkpoint saved
        before they were counted). With settings overridden (--override-resume) this run's optimizer settings and
        schedule replace the checkpoint's, and a sample order that no longer matches starts its epoch over."""
        where = f"{resume.directory}/{resume.tag}"
        state = self.checkpoints.load(engine, resume, keep_schedule=not overridden)
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
        return step, int(state.get(NONFINITE, 0))
