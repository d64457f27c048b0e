"""What acts beside the step loop at its moments, without the loop knowing what it is: a `TrainHook` is told after each
optimizer step, saves its part of each checkpoint, lends its weights to a validation round and has its say before
the final export. The EMA is one; a new one is a class here and a line in `hooks_for`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from stk.log import get_logger
from stk.train.checkpoint.store import Resume
from stk.train.options import TrainOptions
from stk.train.trainable.ema import ShardedEma

__all__ = ["EmaHook", "TrainHook", "hooks_applied", "hooks_for"]

log = get_logger("train")


class TrainHook:
    """A hook does nothing at a moment it does not override. Every method is called on every rank."""

    def after_step(self, step: int) -> None:
        """Optimizer step `step` is done (before the ranks agree on it)."""

    def save(self, folder: str) -> list[str]:
        """Write this rank's part of the checkpoint in `folder`; returns the files written."""
        return []

    def applied(self) -> AbstractContextManager[None]:
        """The weights a validation round makes its images with, for the round's duration."""
        return nullcontext()

    def before_export(self, export: Callable[[str], str]) -> None:
        """Before OUTPUT/final is written; `export(name)` writes the trained weights to OUTPUT/name."""


class EmaHook(TrainHook):
    """The sharded EMA (stk.train.trainable.ema): updated after each step, saved in each checkpoint, swapped in for
    validation rounds, and exported as final/ with the raw weights in final-no-ema/ (as diffusers' examples save it)."""

    def __init__(self, ema: ShardedEma) -> None:
        self.ema = ema

    def after_step(self, step: int) -> None:
        self.ema.update(step)

    def save(self, folder: str) -> list[str]:
        return [self.ema.save(folder)]

    def applied(self) -> AbstractContextManager[None]:
        return self.ema.applied()

    def before_export(self, export: Callable[[str], str]) -> None:
        export("final-no-ema")
        self.ema.apply()


def hooks_for(opts: TrainOptions, module: Any, rank: int, world_size: int, resume: Resume | None) -> list[TrainHook]:
    """The hooks `opts` asks for, around the engine's module, resumed from `resume`'s folder."""
    hooks: list[TrainHook] = []
    if opts.ema_decay:
        ema = ShardedEma(module, opts.ema_decay, opts.ema_every, rank, world_size)
        if resume is not None:
            ema.load(os.path.join(resume.directory, resume.tag))
        log.info("EMA (decay %g) of %d trained weights, %d on this rank", opts.ema_decay, ema.total, len(ema.shadow))
        hooks.append(EmaHook(ema))
    return hooks


@contextmanager
def hooks_applied(hooks: list[TrainHook]) -> Iterator[None]:
    """Every hook's weights in the module for the duration."""
    with ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook.applied())
        yield
