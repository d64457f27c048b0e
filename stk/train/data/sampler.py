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

Several datasets: the unit drawn from is a group, (dataset name, latent h, latent w), with its own keys and repeats;
two datasets never share a group, even at the same size. A run of one dataset names it "" and draws exactly the
sequence above. Without weights an epoch is every group's optimizer steps shuffled together, so the samples of an
epoch follow the repeats exactly. With weights an epoch has as many optimizer steps, each drawn from a dataset picked
by weight (an RNG of seed and epoch alone, so every rank draws the same); a dataset hands out its next optimizer step
from its own stream of passes (pass k: its groups' steps shuffled by seed, epoch, name and k), so a small dataset
cycles and a large one is seen in part.

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

__all__ = ["BucketKeys", "BucketSampler", "Group", "key_array"]

BucketShape = tuple[int, int]
Group = tuple[str, int, int]  # (dataset name, latent h, latent w); "" for a run of one dataset
BucketKeys = Sequence[str] | np.ndarray  # a bucket's keys: strings, or UTF-8 bytes (a numpy "S" array)
_HASH_CHUNK = 65_536  # keys joined at a time for the fingerprint


class BucketSampler:
    """Yields this rank's keys for one micro-step at a time, and resumes at exactly the next one.

    `buckets` and `repeats` are keyed by latent (h, w) for a run of one dataset, or by Group; `weights` (dataset name
    -> weight, every dataset named) draws each optimizer step's dataset by weight. `state_dict()` records the samples
    of the epoch yielded so far, by all ranks; a loader that prefetches runs ahead of training, so stk-train passes
    the micro-steps it actually trained.
    """

    def __init__(
        self,
        buckets: Mapping[BucketShape, BucketKeys] | Mapping[Group, BucketKeys],
        repeats: Mapping[BucketShape, int] | Mapping[Group, int] | int,
        batch_size: int,
        world_size: int,
        rank: int,
        grad_accum: int = 1,
        seed: int = 0,
        drop_last: bool = True,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if min(batch_size, world_size, grad_accum) < 1:
            raise ValueError("batch size, world size and gradient accumulation must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        groups = {_group(key): keys for key, keys in buckets.items()}
        self._keys = {g: key_array(groups[g]) for g in sorted(groups) if len(groups[g])}
        self._offsets = np.cumsum([0] + [len(keys) for keys in self._keys.values()])  # positions of each group
        self._dataset_of = [name for name, _, _ in self._keys]  # each group's dataset, by the plan's group index
        given = repeats if isinstance(repeats, int) else {_group(key): value for key, value in repeats.items()}
        self._repeats = {g: _repeats_for(given, g) for g in self._keys}
        self._weights = _checked_weights(weights, set(self._dataset_of))
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.grad_accum, self.seed, self.drop_last = grad_accum, seed, drop_last
        self.global_batch = batch_size * world_size
        self.effective_batch = self.global_batch * grad_accum
        # optimizer steps per group: the same every epoch, since only the order changes
        self._steps = {g: self._bucket_steps(len(keys) * self._repeats[g]) for g, keys in self._keys.items()}
        self.skipped: dict[BucketShape | Group, int] = {
            _shown(g): len(keys) * self._repeats[g] for g, keys in self._keys.items() if not self._steps[g]
        }
        self.steps_per_epoch = sum(self._steps.values())
        self.fingerprint = self._fingerprint()
        self.epoch, self.step = 0, 0
        self._plan: np.ndarray | None = None  # (micro-steps, batch_size) positions
        self._plan_groups = np.zeros(0, np.int64)  # the group of each micro-step of the plan

    def __len__(self) -> int:
        """Micro-steps per epoch (the same on every rank)."""
        return self.steps_per_epoch * self.grad_accum

    def __iter__(self) -> Iterator[list[str]]:
        plan = self._epoch_plan()
        groups = list(self._keys.values())
        while self.step < len(plan):
            group = int(self._plan_groups[self.step])
            keys = groups[group][plan[self.step] - self._offsets[group]]
            self.step += 1
            yield [key.decode("utf-8", "surrogateescape") for key in keys.tolist()]

    def dataset_at(self, micro_step: int) -> str:
        """The dataset of micro-step `micro_step` of this epoch ("" in a run of one dataset, and past its end): the
        same on every rank, and for every micro-step of an optimizer step."""
        self._epoch_plan()
        if not 0 <= micro_step < len(self._plan_groups):
            return ""
        return self._dataset_of[int(self._plan_groups[micro_step])]

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
                "drop_last, the datasets and their weights) changed since the checkpoint, so the saved position "
                "means a different sequence of samples"
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
        (ranks, batch size, accumulation) is not in it: the steps hold the same samples whatever the split. A run of
        one dataset hashes what it always did."""
        digest = hashlib.sha256()
        settings = [self.effective_batch, self.drop_last]
        digest.update(json.dumps(settings).encode())
        for g, keys in self._keys.items():
            digest.update(json.dumps([_shown(g), len(keys), self._repeats[g]]).encode())
            for start in range(0, len(keys), _HASH_CHUNK):  # the bytes of "\0".join(keys), a chunk at a time
                digest.update((b"\0" if start else b"") + b"\0".join(keys[start : start + _HASH_CHUNK].tolist()))
        if self._weights is not None:
            digest.update(json.dumps({"weights": self._weights}, sort_keys=True).encode())
        return digest.hexdigest()[:16]

    def _epoch_plan(self) -> np.ndarray:
        """This rank's micro-steps for the current epoch (positions of keys), computed once per epoch."""
        if self._plan is not None:
            return self._plan
        lo = self.rank * self.batch_size  # this rank's samples of each global batch of an optimizer step
        mine = (
            np.arange(0, self.effective_batch, self.global_batch)[:, None] + lo + np.arange(self.batch_size)
        ).ravel()
        if self._weights is None:
            every, groups = self._shuffled_steps(list(range(len(self._keys))), mine, f"{self.epoch}")
            order = list(range(len(every)))
            random.Random(f"stk-steps:{self.seed}:{self.epoch}").shuffle(order)
            every, groups = every[order], groups[order]
        else:
            every, groups = self._weighted_steps(mine)
        self._plan = every.reshape(-1, self.batch_size)
        self._plan_groups = np.repeat(groups, self.grad_accum)
        return self._plan

    def _shuffled_steps(self, indices: list[int], mine: np.ndarray, draw: str) -> tuple[np.ndarray, np.ndarray]:
        """The optimizer steps of these groups (this rank's samples of each), group by group, each group's samples
        shuffled by the seed, `draw` (the epoch, and a dataset's pass) and the group; and each step's group."""
        steps, owners, chosen = [], [], set(indices)
        for index, (g, keys) in enumerate(self._keys.items()):
            if index not in chosen:
                continue
            order = list(range(len(keys) * self._repeats[g]))  # the group's keys, repeated
            random.Random(f"stk-bucket:{self.seed}:{draw}:{_seeded(g)}").shuffle(order)
            samples = np.array(order, np.int64) % len(keys) + self._offsets[index]
            del order
            # drop_last: whole steps only; else the tail is filled by cycling the shuffled samples
            samples = np.resize(samples, self._steps[g] * self.effective_batch)
            steps.append(samples.reshape(-1, self.effective_batch)[:, mine])
            owners.append(np.full(self._steps[g], index, np.int64))
        if not steps:
            return np.zeros((0, len(mine)), np.int64), np.zeros(0, np.int64)
        return np.concatenate(steps), np.concatenate(owners)

    def _weighted_steps(self, mine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An epoch's optimizer steps drawn dataset by weight (a pure function of seed and epoch), each dataset handing
        out the next step of its stream of passes."""
        weights = self._weights or {}
        names = [name for name in sorted(weights) if any(self._steps[g] for g in self._keys if g[0] == name)]
        if not names:
            return np.zeros((0, len(mine)), np.int64), np.zeros(0, np.int64)
        rng = random.Random(f"stk-weights:{self.seed}:{self.epoch}")
        drawn = np.array(rng.choices(range(len(names)), [weights[n] for n in names], k=self.steps_per_epoch))
        every = np.zeros((len(drawn), len(mine)), np.int64)
        groups = np.zeros(len(drawn), np.int64)
        for at, name in enumerate(names):
            wanted = np.flatnonzero(drawn == at)
            every[wanted], groups[wanted] = self._dataset_stream(name, len(wanted), mine)
        return every, groups

    def _dataset_stream(self, name: str, count: int, mine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first `count` optimizer steps of dataset `name`'s passes this epoch (pass k: its groups' steps shuffled
        by seed, epoch, name and k), and their groups."""
        indices = [index for index, g in enumerate(self._keys) if g[0] == name]
        parts, owners, held, k = [], [], 0, 0
        while held < count:
            steps, groups = self._shuffled_steps(indices, mine, f"{self.epoch}:{k}")
            order = list(range(len(steps)))
            random.Random(f"stk-pass:{self.seed}:{self.epoch}:{name}:{k}").shuffle(order)
            parts.append(steps[order])
            owners.append(groups[order])
            held, k = held + len(steps), k + 1
        if not parts:
            return np.zeros((0, len(mine)), np.int64), np.zeros(0, np.int64)
        return np.concatenate(parts)[:count], np.concatenate(owners)[:count]


def key_array(keys: BucketKeys) -> np.ndarray:
    """A bucket's keys as a bytes array (UTF-8; kept as given when it is one already)."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind == "S":
        return keys
    return np.array([str(key).encode("utf-8", "surrogateescape") for key in keys], dtype=bytes)


def _group(key: BucketShape | Group) -> Group:
    """A bucket's key as a Group: a latent (h, w) belongs to the one dataset ""."""
    return ("", int(key[0]), int(key[1])) if len(key) == 2 else (str(key[0]), int(key[1]), int(key[2]))


def _shown(group: Group) -> BucketShape | Group:
    """How a group is named (messages, the fingerprint): as (h, w) in a run of one dataset, as it always was."""
    return group[1:] if not group[0] else group


def _seeded(group: Group) -> str:
    """A group's part of its shuffle's seed: "64x64", or "photos:64x64" for a named dataset's."""
    name, h, w = group
    return f"{name}:{h}x{w}" if name else f"{h}x{w}"


def _described(group: Group) -> str:
    name, h, w = group
    return f"bucket {h}x{w}" + (f" of dataset {name!r}" if name else "")


def _repeats_for(repeats: Mapping[Group, int] | int, group: Group) -> int:
    if isinstance(repeats, int):
        value = repeats
    elif group in repeats:
        value = repeats[group]
    else:
        raise ValueError(f"no repeats given for {_described(group)}")
    if value < 1:
        raise ValueError(f"repeats for {_described(group)} must be at least 1, not {value}")
    return value


def _checked_weights(weights: Mapping[str, float] | None, names: set[str]) -> dict[str, float] | None:
    """The weights of the datasets drawn from (every one named, each positive), or None: no weighted draw."""
    if weights is None:
        return None
    missing = sorted(names - set(weights))
    if missing:
        raise ValueError(f"no weight given for dataset(s) {', '.join(map(repr, missing))}")
    bad = sorted(name for name in names if not weights[name] > 0)
    if bad:
        raise ValueError(f"the weight of dataset {bad[0]!r} must be positive, not {weights[bad[0]]}")
    return {name: float(weights[name]) for name in sorted(names)}
