"""Checkpoints under OUTPUT/checkpoints: one DeepSpeed checkpoint per tag (`step-00001000`), a
`latest` file naming the newest complete one, the last K kept.

DeepSpeed's own `latest` is written by rank 0 as soon as rank 0 has saved, while other ranks may
still be writing their ZeRO shards; a job killed then resumes from a torn checkpoint. Here every
rank saves and syncs its files, all ranks meet at a barrier, and only then does rank 0 replace
`latest` atomically. A checkpoint without `latest` pointing at it is never resumed from, and is
removed by the next save.

Each checkpoint also holds `stk-run.json`, the run settings it was trained with
(`TrainOptions.run_settings`), read before any model loads so that a resume with another seed,
learning rate or batch is refused in seconds with one line. Its world size may differ from the resuming
run's where the effective batch is the same (stk.train.worldsize): such a checkpoint loads from its
universal form.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stk.errors import InputError
from stk.log import get_logger
from stk.storage import write_atomic
from stk.storage.failures import storage_errors
from stk.train.worldsize import UNIVERSAL, effective_batch

__all__ = ["CheckpointDir", "Resume"]

log = get_logger("train.checkpoint")

LATEST = "latest"
SETTINGS = "stk-run.json"
# Weights of another family, or another adapter (or none), cannot be loaded, whatever the user says.
FIXED_SETTINGS = ("family", "lora_rank", "lora_targets")
# How the effective batch is split: another split of the same effective batch is the same run.
SPLIT_SETTINGS = ("world_size", "grad_accum")
_TAG = re.compile(r"^step-(\d{8,})$")


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Resume:
    directory: str  # the checkpoints directory DeepSpeed loads from
    tag: str
    universal: bool = False  # saved on another number of ranks: loaded from its universal checkpoint


class CheckpointDir:
    """OUTPUT/checkpoints. `save` and `load` are collective (every rank calls them)."""

    def __init__(self, output_dir: str, keep: int, rank: int, frozen_base: bool = False) -> None:
        if keep < 1:
            raise InputError(f"--keep-checkpoints {keep}: keep at least 1")
        self.path = os.path.join(output_dir, "checkpoints")
        self.keep = keep
        self.rank = rank
        # LoRA: the frozen weights are --model's, loaded again on resume; a checkpoint holds the adapter only
        self.frozen_base = frozen_base

    def latest(self) -> str | None:
        """The tag `latest` names, if that checkpoint is there."""
        try:
            with open(os.path.join(self.path, LATEST), encoding="utf-8") as f:
                tag = f.read().strip()
        except FileNotFoundError:
            return None
        if not tag or not os.path.isdir(os.path.join(self.path, tag)):
            raise InputError(f"{self.path}/{LATEST} names {tag!r}, which is not there: remove it to start over")
        return tag

    def resolve(self, resume: str) -> Resume | None:
        """--resume: "auto" (the latest checkpoint, or none yet), "none", or a checkpoint directory."""
        if resume == "none":
            return None
        if resume == "auto":
            tag = self.latest()
            return Resume(self.path, tag) if tag else None
        path = os.path.abspath(resume.rstrip("/"))
        if not os.path.isdir(path):
            raise InputError(f"--resume {resume}: no such checkpoint directory (or give auto / none)")
        return Resume(os.path.dirname(path), os.path.basename(path))

    def save(
        self,
        engine: Any,
        step: int,
        client_state: dict[str, Any],
        settings: dict[str, Any],
        also: Callable[[str], None] | None = None,
    ) -> str:
        """Save on every rank, then move `latest` (rank 0) once all have finished; prune old ones. `also` is called
        on every rank with the checkpoint's folder, to add files before `latest` names it."""
        import torch.distributed as dist

        tag = tag_for(step)
        folder = os.path.join(self.path, tag)
        with storage_errors(folder):  # torch.save's errors on a full disk name no errno
            engine.save_checkpoint(
                self.path,
                tag=tag,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=self.frozen_base,
            )
            if self.rank == 0:
                write_atomic(os.path.join(folder, SETTINGS), json.dumps(settings, sort_keys=True).encode())
        if also is not None:
            also(folder)
        os.sync()  # this rank's files on stable storage before `latest` can point at them
        dist.barrier()
        if self.rank == 0:
            write_atomic(os.path.join(self.path, LATEST), tag.encode())
            self._prune(keep_tag=tag)
            log.info("checkpoint %s saved", os.path.join(self.path, tag))
        dist.barrier()
        return tag

    def load(self, engine: Any, resume: Resume, keep_schedule: bool = True) -> dict[str, Any]:
        """Load parameters, optimizer and (with `keep_schedule`) the LR schedule; returns the client
        state saved with them."""
        directory, tag = resume.directory, resume.tag
        if resume.universal:  # the engine was built with "checkpoint": {"load_universal": true}
            directory, tag = os.path.join(resume.directory, resume.tag), UNIVERSAL
        path, client_state = engine.load_checkpoint(
            directory,
            tag=tag,
            load_module_strict=not self.frozen_base,  # the frozen weights are not in it (check_settings: same adapter)
            load_optimizer_states=True,
            load_lr_scheduler_states=keep_schedule,
        )
        if path is None or not client_state or "stk" not in client_state:
            raise InputError(f"{resume.directory}/{resume.tag}: not a complete stk-train checkpoint")
        state: dict[str, Any] = client_state["stk"]
        return state

    def saved_settings(self, resume: Resume) -> dict[str, Any]:
        """The run settings the checkpoint was trained with (empty for checkpoints without the record)."""
        try:
            with open(os.path.join(resume.directory, resume.tag, SETTINGS), encoding="utf-8") as f:
                saved: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            return {}
        return saved

    def check_settings(self, resume: Resume, current: dict[str, Any], override: bool) -> list[str]:
        """The settings that differ from the checkpoint's ("seed 0 -> 1"); raise InputError unless
        `override` (and always for FIXED_SETTINGS). Another split of the same effective batch is no
        change. Checkpoints without the record are not checked."""
        saved = self.saved_settings(resume)
        changed = [k for k in current if k in saved and saved[k] != current[k]]
        if effective_batch(saved) == effective_batch(current):
            changed = [k for k in changed if k not in SPLIT_SETTINGS]
        if not changed:
            return []
        described = [f"{k.replace('_', '-')} {saved[k]} -> {current[k]}" for k in changed]
        where = f"{resume.directory}/{resume.tag}"
        fixed = [k for k in changed if k in FIXED_SETTINGS]
        if fixed:
            other = ", ".join(described)
            raise InputError(f"cannot resume {where}: it holds other weights ({other}); use another --output-dir")
        if not override:
            raise InputError(
                f"resuming {where} with other settings than it was trained with ({', '.join(described)}): "
                "rerun with the checkpoint's values, use another --output-dir, or add --override-resume"
            )
        log.warning("--override-resume: continuing %s with %s", where, ", ".join(described))
        return changed

    def _prune(self, keep_tag: str) -> None:
        """Keep the newest `keep` complete checkpoints; incomplete ones (newer than `latest`, from a
        killed save) go too."""
        tags = sorted((int(m.group(1)), name) for name in os.listdir(self.path) if (m := _TAG.match(name)))
        keep_step = int(keep_tag.removeprefix("step-"))
        complete = [name for step, name in tags if step <= keep_step]
        doomed = complete[: -self.keep] + [name for step, name in tags if step > keep_step]
        for name in doomed:
            shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
