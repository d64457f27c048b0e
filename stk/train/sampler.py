"""The distributed bucket sampler: which cache keys each rank trains on, micro-step by micro-step.

Every global micro-step draws from ONE bucket on every rank, so all ranks run the same latent
shape and none waits on a bigger one; the grad_accum micro-steps of an optimizer step share it too.

An epoch is a pure function of the seed, the epoch number and the buckets, so every rank and every
run computes the same one without communicating:

1. for each bucket, its keys repeated `repeats` times, shuffled by (seed, epoch, bucket);
2. cut into optimizer steps of batch_size x world_size x grad_accum samples, each a run of grad_accum
   global batches (batch_size x world_size samples, one micro-step of all ranks);
3. the optimizer steps of all buckets shuffled by (seed, epoch);
4. rank r takes samples [r * batch_size, (r + 1) * batch_size) of each global batch.

With drop_last (the default) the incomplete tail of each bucket is dropped, so a bucket holding
fewer samples (keys x repeats) than one effective batch contributes nothing: it is listed in
`skipped`. stk-scan's batch check fails on such buckets unless --allow-oversubscription raises their
repeats (buckets.json's per-bucket "repeats"). Without drop_last the tail is filled up to a whole
optimizer step by cycling the bucket's shuffled samples, so every bucket is seen.

A repeated key may land twice in one batch; that is what repeats mean for a tiny bucket.

Keys are held as bytes arrays and an epoch as int64 positions (8 bytes a sample of this rank's share), so 100M
samples are arrays, not Python strings; a micro-step's keys become strings when it is yielded. The shuffles are
Python's `random.shuffle` of positions, the same permutations a shuffle of the keys themselves draws.

The sequence of optimizer steps depends on the effective batch only, not on how it is split into ranks, batch
size and accumulation, so a position saved as samples trained resumes on any number of ranks that keeps the
effective batch: M ranks continue at the same sample as the N that saved it.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["BucketKeys", "BucketSampler", "key_array"]

BucketShape = tuple[int, int]
BucketKeys = Sequence[str] | np.ndarray  # a bucket's keys: strings, or UTF-8 bytes (a numpy "S" array)
_HASH_CHUNK = 65_536  # keys joined at a time for the fingerprint


class BucketSampler:
    """Yields this rank's keys for one micro-step at a time, and resumes at exactly the next one.

    `state_dict()` records the samples of the epoch yielded so far, by all ranks; a loader that prefetches runs
    ahead of training, so stk-train passes the micro-steps it actually trained.
    """

    def __init__(
        self,
        buckets: Mapping[BucketShape, BucketKeys],
        repeats: Mapping[BucketShape, int] | int,
        batch_size: int,
        world_size: int,
        rank: int,
        grad_accum: int = 1,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if min(batch_size, world_size, grad_accum) < 1:
            raise ValueError("batch size, world size and gradient accumulation must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self._keys = {hw: key_array(buckets[hw]) for hw in sorted(buckets) if len(buckets[hw])}
        self._offsets = np.cumsum([0] + [len(keys) for keys in self._keys.values()])  # positions of each bucket
        self._repeats = {hw: _repeats_for(repeats, hw) for hw in self._keys}
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.grad_accum, self.seed, self.drop_last = grad_accum, seed, drop_last
        self.global_batch = batch_size * world_size
        self.effective_batch = self.global_batch * grad_accum
        # optimizer steps per bucket: the same every epoch, since only the order changes
        self._steps = {hw: self._bucket_steps(len(keys) * self._repeats[hw]) for hw, keys in self._keys.items()}
        self.skipped: dict[BucketShape, int] = {
            hw: len(keys) * self._repeats[hw] for hw, keys in self._keys.items() if not self._steps[hw]
        }
        self.steps_per_epoch = sum(self._steps.values())
        self.fingerprint = self._fingerprint()
        self.epoch, self.step = 0, 0
        self._plan: np.ndarray | None = None  # (micro-steps, batch_size) positions

    def __len__(self) -> int:
        """Micro-steps per epoch (the same on every rank)."""
        return self.steps_per_epoch * self.grad_accum

    def __iter__(self) -> Iterator[list[str]]:
        plan = self._epoch_plan()
        buckets = list(self._keys.values())
        while self.step < len(plan):
            positions = plan[self.step]
            bucket = int(np.searchsorted(self._offsets, positions[0], side="right")) - 1
            keys = buckets[bucket][positions - self._offsets[bucket]]
            self.step += 1
            yield [key.decode("utf-8", "surrogateescape") for key in keys.tolist()]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first micro-step; the current epoch keeps its position, so the usual
        `set_epoch(epoch)` at the top of the epoch loop does not undo a `load_state_dict`."""
        if epoch != self.epoch:
            self.epoch, self.step, self._plan = epoch, 0, None

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        """The position after `trained` micro-steps of this epoch (default: those yielded), in samples of all ranks:
        the same number whatever the world size."""
        samples = (self.step if trained is None else trained) * self.global_batch
        return {"epoch": self.epoch, "samples": samples, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                "cannot resume the sampler: the cache's buckets or the batch settings (effective batch, repeats, "
                "drop_last) changed since the checkpoint, so the saved position means a different sequence of samples"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"cannot resume the sampler: the checkpoint used seed {state['seed']}, not {self.seed}")
        samples = state["samples"]
        if samples % self.global_batch or not 0 <= samples // self.global_batch <= len(self):
            raise ValueError(
                f"sampler position {samples} is not a micro-step of {self.global_batch} samples in [0, {len(self)}]"
            )
        self.epoch, self.step, self._plan = state["epoch"], samples // self.global_batch, None

    def _bucket_steps(self, samples: int) -> int:
        if self.drop_last:
            return samples // self.effective_batch
        return -(-samples // self.effective_batch)

    def _fingerprint(self) -> str:
        """Hash of everything but the seed that decides the sequence of optimizer steps (keys included: a rebuilt
        cache with the same bucket sizes but other keys must not resume silently). How the effective batch is split
        (ranks, batch size, accumulation) is not in it: the steps hold the same samples whatever the split."""
        digest = hashlib.sha256()
        settings = [self.effective_batch, self.drop_last]
        digest.update(json.dumps(settings).encode())
        for hw, keys in self._keys.items():
            digest.update(json.dumps([hw, len(keys), self._repeats[hw]]).encode())
            for start in range(0, len(keys), _HASH_CHUNK):  # the bytes of "\0".join(keys), a chunk at a time
                digest.update((b"\0" if start else b"") + b"\0".join(keys[start : start + _HASH_CHUNK].tolist()))
        return digest.hexdigest()[:16]

    def _epoch_plan(self) -> np.ndarray:
        """This rank's micro-steps for the current epoch (positions of keys), computed once per epoch."""
        if self._plan is not None:
            return self._plan
        lo = self.rank * self.batch_size  # this rank's samples of each global batch of an optimizer step
        mine = (
            np.arange(0, self.effective_batch, self.global_batch)[:, None] + lo + np.arange(self.batch_size)
        ).ravel()
        steps = []  # optimizer steps of each bucket: this rank's samples of each
        for bucket, (hw, keys) in enumerate(self._keys.items()):
            order = list(range(len(keys) * self._repeats[hw]))  # the bucket's keys, repeated
            random.Random(f"stk-bucket:{self.seed}:{self.epoch}:{hw[0]}x{hw[1]}").shuffle(order)
            samples = np.array(order, np.int64) % len(keys) + self._offsets[bucket]
            del order
            # drop_last: whole steps only; else the tail is filled by cycling the shuffled samples
            samples = np.resize(samples, self._steps[hw] * self.effective_batch)
            steps.append(samples.reshape(-1, self.effective_batch)[:, mine])
        every = np.concatenate(steps) if steps else np.zeros((0, len(mine)), np.int64)
        order = list(range(len(every)))
        random.Random(f"stk-steps:{self.seed}:{self.epoch}").shuffle(order)
        self._plan = every[order].reshape(-1, self.batch_size)
        return self._plan


def key_array(keys: BucketKeys) -> np.ndarray:
    """A bucket's keys as a bytes array (UTF-8; kept as given when it is one already)."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind == "S":
        return keys
    return np.array([str(key).encode("utf-8", "surrogateescape") for key in keys], dtype=bytes)


def _repeats_for(repeats: Mapping[BucketShape, int] | int, hw: BucketShape) -> int:
    if isinstance(repeats, int):
        value = repeats
    elif hw in repeats:
        value = repeats[hw]
    else:
        raise ValueError(f"no repeats given for bucket {hw[0]}x{hw[1]}")
    if value < 1:
        raise ValueError(f"repeats for bucket {hw[0]}x{hw[1]} must be at least 1, not {value}")
    return value
