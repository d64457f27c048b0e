"""An exponential moving average of the trained weights, sharded: each rank keeps, in fp32, the average of only its
own 1/world share of the trainable weights (4 bytes x trainable parameters / world per rank, where trainers that
keep the EMA as a model copy spend 4 bytes x parameters on every rank).

Shares: under ZeRO-3 a rank's share is DeepSpeed's own partition of each weight (`param.ds_tensor`, what the rank
holds anyway); otherwise every rank holds every weight, and the trainable weights, laid end to end in the module's
order, are cut into `world` contiguous ranges. Either way a share is a list of pieces (weight name, first and last
element), which is how checkpoints record it: `ema/rank-NNNNN.pt` beside DeepSpeed's files. A run on another number
of ranks (or another ZeRO stage) cuts its shares out of the saved ones by those pieces.

Update k (from 1, every `every` optimizer steps) moves the average toward the weights with decay
min(D, (1 + t) / (10 + t)), t = k - 1, and 0 at the first (the average starts as the weights after one
update): diffusers' EMAModel ramp, so an average of a few updates is not mostly the untrained weights. The
weights read are the module's (bf16 under bf16 training: the optimizer's fp32 copy is DeepSpeed's, and
partitioned differently per stage).

At the end, `apply` writes the average into the module's weights on every rank (a collective outside ZeRO-3), so
the usual export writes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from stk.errors import InputError
from stk.log import get_logger

__all__ = ["EMA_DIR", "ShardedEma", "ema_decay"]

log = get_logger("train.ema")

EMA_DIR = "ema"


def ema_decay(update: int, decay: float) -> float:
    """The decay of the `update`-th update (from 1)."""
    t = update - 1
    return 0.0 if t <= 0 else min(decay, (1 + t) / (10 + t))


@dataclass(frozen=True)
class _Piece:
    name: str
    param: torch.nn.Parameter
    start: int  # first element of the weight, flat, in this rank's share
    stop: int

    def view(self, zero3: bool) -> torch.Tensor:
        """The piece's current values, flat: in the rank's partition (ZeRO-3) or the whole weight."""
        if zero3:
            partitioned: Any = self.param
            return partitioned.ds_tensor.view(-1)[: self.stop - self.start]
        return self.param.data.view(-1)[self.start : self.stop]


class ShardedEma:
    def __init__(self, module: torch.nn.Module, decay: float, every: int, rank: int, world: int) -> None:
        if not 0 < decay < 1:
            raise InputError(f"--ema-decay {decay:g}: between 0 and 1 (0.9999 is usual), or 0 for no EMA")
        self.decay, self.every, self.rank, self.world = decay, every, rank, world
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.zero3 = bool(trainable) and hasattr(trainable[0][1], "ds_tensor")
        self.pieces = self._zero3_pieces(trainable) if self.zero3 else self._range_pieces(trainable)
        self._trainable = [p for _, p in trainable]  # in the order the ranges cut them
        self.total = sum(p.numel() for p in self._trainable)
        self.updates = 0
        with torch.no_grad():
            self.shadow = torch.cat([piece.view(self.zero3).float() for piece in self.pieces] or [torch.zeros(0)])
        self._shadow_views = list(self.shadow.split([p.stop - p.start for p in self.pieces]))

    def _range_pieces(self, trainable: list[tuple[str, torch.nn.Parameter]]) -> list[_Piece]:
        total = sum(p.numel() for _, p in trainable)
        first, last = self.rank * total // self.world, (self.rank + 1) * total // self.world
        pieces, offset = [], 0
        for name, param in trainable:
            start, stop = max(first - offset, 0), min(last - offset, param.numel())
            if start < stop:
                pieces.append(_Piece(name, param, start, stop))
            offset += param.numel()
        return pieces

    def _zero3_pieces(self, trainable: list[tuple[str, torch.nn.Parameter]]) -> list[_Piece]:
        pieces = []
        for name, param in trainable:
            partitioned: Any = param  # DeepSpeed adds ds_tensor (this rank's part) and ds_numel to ZeRO-3 weights
            size = partitioned.ds_tensor.numel()
            start = self.rank * size
            stop = min(start + size, partitioned.ds_numel)  # the last rank's part is padded
            if start < stop:
                pieces.append(_Piece(name, param, start, stop))
        return pieces

    @property
    def layout(self) -> list[tuple[str, int, int]]:
        return [(p.name, p.start, p.stop) for p in self.pieces]

    def update(self, step: int) -> None:
        """After optimizer step `step`: move the average toward the weights, every `every` steps."""
        if step % self.every:
            return
        self.updates += 1
        if not self.pieces:
            return
        with torch.no_grad():
            current = [piece.view(self.zero3).float() for piece in self.pieces]
            torch._foreach_lerp_(self._shadow_views, current, 1.0 - ema_decay(self.updates, self.decay))

    # ---------------------------------------------------------------- checkpoints

    def save(self, folder: str) -> str:
        """This rank's share into `folder`/ema/ (every rank writes its own file); returns the file."""
        os.makedirs(os.path.join(folder, EMA_DIR), exist_ok=True)
        state = {"shadow": self.shadow, "updates": self.updates, "layout": self.layout, "world": self.world}
        path = _shard_path(folder, self.rank)
        torch.save(state, path)
        return path

    def load(self, folder: str) -> None:
        """This rank's share from a checkpoint's: its own file where the shares are the same, else cut from the
        shares of every rank that saved it (another number of ranks, or another ZeRO stage)."""
        own = os.path.exists(_shard_path(folder, self.rank))
        state = _load_shard(folder, self.rank if own else 0)  # rank 0 saved one whenever an EMA was saved
        if state["world"] == self.world and [tuple(p) for p in state["layout"]] == self.layout:
            self.shadow.copy_(state["shadow"])
        else:
            self._reshard(folder, int(state["world"]))
        self.updates = int(state["updates"])

    def _reshard(self, folder: str, saved_world: int) -> None:
        """Fill this rank's pieces from the overlapping pieces of the `saved_world` saved shares (memory-mapped: a
        rank reads what it keeps). Every element must be found: else the weights are others."""
        wanted: dict[str, list[tuple[int, int, int]]] = {}  # weight -> (start, stop, offset in the shadow)
        offset = 0
        for piece in self.pieces:
            wanted.setdefault(piece.name, []).append((piece.start, piece.stop, offset))
            offset += piece.stop - piece.start
        found = 0
        for rank in range(saved_world):
            state = _load_shard(folder, rank, mmap=True)
            at = 0
            for name, start, stop in state["layout"]:
                for mine_start, mine_stop, mine_at in wanted.get(name, ()):
                    lo, hi = max(start, mine_start), min(stop, mine_stop)
                    if lo < hi:
                        self.shadow[mine_at + lo - mine_start : mine_at + hi - mine_start] = state["shadow"][
                            at + lo - start : at + hi - start
                        ]
                        found += hi - lo
                at += stop - start
        if found != self.shadow.numel():
            raise InputError(
                f"{folder}/{EMA_DIR}: the EMA saved on {saved_world} ranks holds other weights than this run trains; "
                "resume with the checkpoint's model and --lora-* settings, or use another --output-dir"
            )
        log.info("EMA re-sharded from %d ranks to %d", saved_world, self.world)

    # ---------------------------------------------------------------- export

    def apply(self) -> None:
        """Write the average into the module's weights, on every rank (a collective outside ZeRO-3)."""
        self._write(self.shadow)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The average in the module's weights for the duration (validation images), the trained weights back after;
        every rank (a collective outside ZeRO-3). Costs this rank's share in fp32 while it lasts."""
        with torch.no_grad():
            trained = torch.cat([piece.view(self.zero3).float() for piece in self.pieces] or [torch.zeros(0)])
        self.apply()
        try:
            yield
        finally:
            self._write(trained)

    def _write(self, share: torch.Tensor) -> None:
        """Every rank's `share` (values laid out as its pieces) into the module's weights."""
        with torch.no_grad():
            if self.zero3:
                # DeepSpeed keeps weights under its persistence threshold (LoRA's, say) whole on every rank and
                # forward passes read those copies: partitioned first, gathered again from the written partitions
                persistent: list[Any] = [p for p in self._trainable if getattr(p, "ds_persist", False)]
                if persistent:
                    persistent[0].partition(persistent)
                sizes = [p.stop - p.start for p in self.pieces]
                for piece, values in zip(self.pieces, share.split(sizes), strict=True):
                    piece.view(True).copy_(values)
                if persistent:
                    persistent[0].all_gather(persistent)
                return
            full = self._gather(share)
            offset = 0
            for param in self._trainable:
                n = param.numel()
                param.data.view(-1).copy_(full[offset : offset + n])
                offset += n

    def _gather(self, share: torch.Tensor) -> torch.Tensor:
        """Every rank's range of values, all-gathered (padded to equal sizes) into the whole flat weights."""
        import torch.distributed as dist

        if self.world == 1:
            return share
        size = -(-self.total // self.world)  # the largest range
        mine = torch.zeros(size)
        mine[: share.numel()] = share
        mine = mine.to(self._trainable[0].device)  # NCCL gathers on the GPU
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        parts = [
            g[: (r + 1) * self.total // self.world - r * self.total // self.world].cpu() for r, g in enumerate(gathered)
        ]
        return torch.cat(parts)


def _shard_path(folder: str, rank: int) -> str:
    return os.path.join(folder, EMA_DIR, f"rank-{rank:05d}.pt")


def _load_shard(folder: str, rank: int, mmap: bool = False) -> dict[str, Any]:
    path = _shard_path(folder, rank)
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise InputError(
            f"{folder} has no EMA ({path} missing): it was trained without --ema-decay; resume without it "
            "or use another --output-dir"
        ) from None
    return state
