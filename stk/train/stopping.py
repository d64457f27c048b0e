"""Why training stops early, agreed by every rank at each optimizer step boundary.

SIGUSR2 (Slurm's `--signal=B:USR2@180` before a time limit or preemption) and SIGTERM set a flag
once the step loop runs (before, they end the run at once: StopSignals); the GPU watch sets another.
One small all-reduce per optimizer step makes every rank see the same flags at the same step, so all
ranks checkpoint together (a signal) or all stop (a fault), even when the signal reached only one
process.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stk.cluster.slurm import STOP_SIGNALS
from stk.cluster.world import exit_now
from stk.errors import ExitCode
from stk.log import get_logger

__all__ = ["Agreement", "StopSignals", "agree"]

log = get_logger("train.stop")

STOP_NUMBERS = frozenset(int(sig) for sig in STOP_SIGNALS)


class StopSignals:
    """SIGUSR2/SIGTERM. Once the step loop runs (`defer`), a signal is recorded and the loop checkpoints at the
    next step boundary. Before that (loading, building DeepSpeed's ops, the rendezvous) there is nothing to save
    and no step boundary may come soon, so the signal ends the run at once with the requeue code.

    Python runs signal handlers in the main thread only, between bytecodes: a main thread blocked in C++ (the
    gloo rendezvous) would hold the handler back. So the C-level handler also writes the signal's number to a
    pipe (signal.set_wakeup_fd), and a thread reading it ends the process from there."""

    def __init__(self, end: Callable[[int], object] = exit_now) -> None:
        self.received: str | None = None
        self._end = end  # ends the process with the code it is given (world.exit_now; tests record it)
        self._deferring = False
        self._ending = threading.Lock()  # one line and one end, whichever of the handler and the thread is first
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int, int] | None = None  # the pipe's ends and the wakeup fd it replaced
        self._watcher: threading.Thread | None = None

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block
        self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        self._watcher = threading.Thread(target=self._watch, args=(read,), name="stk-stop-signals", daemon=True)
        self._watcher.start()
        return self

    def defer(self) -> None:
        """The step loop has started: from now on a stop signal waits for the next step boundary."""
        self._deferring = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous.clear()
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watcher reads the end of the pipe and returns
            if self._watcher is not None:
                self._watcher.join()
            os.close(read)
            self._wakeup = None

    def _watch(self, fd: int) -> None:
        while data := os.read(fd, 64):  # the numbers of the signals received (b"" once restore closes the pipe)
            stops = [number for number in data if number in STOP_NUMBERS]
            if stops and not self._deferring:
                self._end_now(signal.Signals(stops[0]).name)

    def _handle(self, signum: int, _frame: types.FrameType | None) -> None:
        if not self._deferring:
            self._end_now(signal.Signals(signum).name)
        elif self.received is None:
            self.received = signal.Signals(signum).name
            log.warning(
                "%s received: checkpointing at the next step boundary, then exiting to be requeued", self.received
            )

    def _end_now(self, name: str) -> None:
        if not self._ending.acquire(blocking=False):
            return
        log.warning(
            "%s received before the first training step (loading, building DeepSpeed's ops or the rendezvous): "
            "exiting now to be requeued; nothing trained since the last checkpoint is lost",
            name,
        )
        self._end(int(ExitCode.REQUEUE))


@dataclass(frozen=True)
class Agreement:
    stop: bool  # some rank got a stop signal: checkpoint and exit with the requeue code
    fault: bool  # some rank's GPU faulted: exit with the GPU-fault code, no checkpoint
    loss: float  # the step's loss averaged over ranks (nan where any rank's was not finite)
    digest: int  # the ranks' digests of their samples summed (mod 2**32): what the step trained on, whatever the ranks
    nonfinite_ranks: int = 0  # the ranks whose loss was nan or inf
    first_nonfinite: int | None = None  # the lowest of them
    grad_norm_nonfinite: bool = False  # the gradient norm (one for the whole step) was nan or inf

    @property
    def finite(self) -> bool:
        """Whether the step's loss on every rank and its gradient norm were finite numbers."""
        return not self.nonfinite_ranks and not self.grad_norm_nonfinite


def agree(
    stop: bool, fault: bool, loss: float, digest: int, device: torch.device, grad_norm: float | None = None
) -> Agreement:
    """Every rank's flags OR-ed, losses averaged, sample digests (below 2**32 each) summed and non-finite losses and
    gradient norms counted, in one all-reduce (collective: every rank calls it at the same optimizer step). float64
    sums them exactly up to 2**21 ranks. Only where a loss was not finite does a second all-reduce find the lowest
    rank it was on, for the line that names it: every rank knows by then that it must take part."""
    import torch.distributed as dist

    bad_loss, bad_norm = not math.isfinite(loss), grad_norm is not None and not math.isfinite(grad_norm)
    values = [float(stop), float(fault), loss, float(digest), float(bad_loss), float(bad_norm)]
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    size, rank = 1, 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        size, rank = dist.get_world_size(), dist.get_rank()
    stop_sum, fault_sum, loss_sum, digest_sum, bad_losses, bad_norms = summed.tolist()
    first = None
    if bad_losses:
        lowest = torch.tensor([rank if bad_loss else size], dtype=torch.float64, device=device)
        if size > 1:
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        first = int(lowest.item())
    return Agreement(
        stop=stop_sum > 0,
        fault=fault_sum > 0,
        loss=loss_sum / size,
        digest=int(digest_sum) % 2**32,
        nonfinite_ranks=int(bad_losses),
        first_nonfinite=first,
        grad_norm_nonfinite=bad_norms > 0,
    )
