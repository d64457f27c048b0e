"""The step loop's validator: when a round of validation images is made (stk.train.validation.plan's plan), and what
becomes of it (stk.train.validation.render makes the images, on every rank; rank 0 writes them and reports them). A
round that fails is a warning: it never stops training.
"""

from __future__ import annotations

import os
import time

import torch

from stk.log import get_logger
from stk.train.data.plan import TrainPlan
from stk.train.hooks import TrainHook, hooks_applied
from stk.train.objective.objectives import Objective
from stk.train.options import TrainOptions
from stk.train.report.metrics import MetricsLog
from stk.train.validation.embeddings import Embeddings
from stk.train.validation.plan import ValidationPlan, plan_validation
from stk.train.validation.render import SAMPLES_DIR, ValidationRenderer, write_round

__all__ = ["Validator", "planned"]

log = get_logger("train")


def planned(opts: TrainOptions, plan: TrainPlan) -> ValidationPlan | None:
    """The images to make (stk.train.validation.plan), the most common bucket weighed by its repeats."""
    sizes: dict[tuple[int, int], int] = {}
    for group, keys in plan.groups.items():  # every dataset's samples of a latent shape
        sizes[group[1:]] = sizes.get(group[1:], 0) + len(keys) * plan.repeats.get(group, 1)
    return plan_validation(opts.validation, plan.family, plan.data.validation_prompts, sizes, plan.vae_scale_factor)


class Validator:
    """Rounds at step 0 (a run from scratch), every `plan.every` steps and after the last, on every rank."""

    def __init__(
        self,
        plan: ValidationPlan,
        objective: Objective,
        module: torch.nn.Module,
        embeddings: Embeddings,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        world_size: int,
        output_dir: str,
    ) -> None:
        self.plan, self.output_dir = plan, output_dir
        self.renderer = ValidationRenderer(plan, objective, module, embeddings, device, dtype, rank, world_size)
        log.info(
            "samples of %d prompts at %dx%d, %d steps: at step 0, every %d steps and at the end (%s/)",
            len(plan.prompts),
            plan.width,
            plan.height,
            plan.steps,
            plan.every,
            os.path.join(output_dir, SAMPLES_DIR),
        )

    def due(self, step: int, last_step: int) -> bool:
        return self.plan.due(step, last_step)

    def baseline(self, step: int, hooks: list[TrainHook], metrics: MetricsLog) -> None:
        """The round before the first step, as a metrics row of its own, when the run starts from scratch."""
        if step != 0:
            return
        seconds = self.validate(0, hooks, metrics)
        if seconds is not None:
            metrics.write({"step": 0, "sample_seconds": seconds, "time": round(time.time(), 3)})

    def validate(self, step: int, hooks: list[TrainHook], metrics: MetricsLog) -> float | None:
        """A round after step `step` on every rank, with the hooks' weights (the EMA's average); rank 0 writes it and
        returns the round's seconds (None elsewhere)."""
        result = self.renderer.render(hooks_applied(hooks))
        if result is None:
            return None
        prompts = self.plan.prompts
        if result.failures:
            kept = f"{len(result.pngs)} of {len(prompts)} written" if result.pngs else "none written"
            log.warning("samples at step %d: %s (%s); training goes on", step, "; ".join(result.failures), kept)
        if result.pngs:
            try:
                metrics.images(step, write_round(self.output_dir, step, prompts, result.pngs))
            except Exception as exc:
                log.warning("samples at step %d not written: %s; training goes on", step, str(exc).splitlines()[0])
        return round(result.seconds, 3)
