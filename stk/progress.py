"""Progress for long work: a tqdm bar on rank 0 when stderr is a terminal, otherwise a log
line every `log_every` seconds (what a sbatch log wants)."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from tqdm import tqdm

from stk.cluster.world import World
from stk.log import get_logger

__all__ = ["Progress"]

log = get_logger("progress")


class Progress:
    def __init__(self, world: World, total: int, unit: str, desc: str, log_every: float = 30.0) -> None:
        self.total = total
        self.unit = unit
        self.desc = desc
        self.count = 0
        self.started = time.monotonic()
        self._log_every = log_every
        self._last_log = self.started
        self._enabled = world.is_root
        self._bar = None
        if self._enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self._enabled and now - self._last_log >= self._log_every:
            self._last_log = now
            rate = self.count / max(now - self.started, 1e-9)
            eta = (self.total - self.count) / rate if rate > 0 else float("inf")
            log.info(
                "%s: %d/%d %s, %.0f %s/s, ETA %.0f s",
                self.desc,
                self.count,
                self.total,
                self.unit,
                rate,
                self.unit,
                eta,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
