"""Work a training step dispatches, counted on the CPU: every aten op that reaches a kernel, below autograd (a
TorchDispatchMode sees the forward's, the backward's and the optimizer's ops alike), with views and allocations apart
because they launch nothing on a GPU, and host syncs (`.item()`, `float(tensor)`) apart because each stalls the GPU's
queue. Op for op these counts equal a GPU profile's kernel launches (bench/RESULTS.md, issue 37), so the count
tracks the per-op overhead that a shared CPU's time hides.

bench/overhead.py counts stk-train's step against the diffusers examples' plain loops with it; tests/unit/train
holds stk's step to the bench's ratio with it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_ops"]

# ops that allocate or relabel memory without a kernel of their own
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "_unsafe_view", "lift_fresh", "set_", "resize_"})
HOST_SYNC = "_local_scalar_dense"  # what .item() and float(tensor) dispatch


@dataclass
class OpCount:
    """What one call dispatched."""

    kernels: Counter[str] = field(default_factory=Counter)  # op name (aten's packet: mm, add_, ...) -> count
    views: int = 0
    allocations: int = 0

    @property
    def ops(self) -> int:
        """Ops that launch a kernel: the number to track."""
        return sum(self.kernels.values())

    @property
    def syncs(self) -> int:
        return self.kernels[HOST_SYNC]

    def beyond(self, other: OpCount, top: int = 8) -> list[tuple[str, int]]:
        """The ops this dispatched more often than `other` did, most extra first."""
        extra = Counter({name: n - other.kernels[name] for name, n in self.kernels.items()})
        return [(name, n) for name, n in extra.most_common(top) if n > 0]


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if func.is_view:
            self.count.views += 1
        elif name in NO_KERNEL:
            self.count.allocations += 1
        else:
            self.count.kernels[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(work: Callable[[], Any]) -> OpCount:
    """What `work()` dispatches, on this thread (the CPU's backward runs on the caller's thread)."""
    count = OpCount()
    with _Counting(count):
        work()
    return count
