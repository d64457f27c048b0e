"""Checkpoints under OUTPUT/checkpoints: one DeepSpeed checkpoint per tag (`step-00001000`), a
`latest` file naming the newest complete one, the last K kept.

DeepSpeed's own `latest` is written by rank 0 as soon as rank 0 has saved, while other ranks may
still be writing their ZeRO shards; a job killed then resumes from a torn checkpoint. Here every
rank saves and syncs its files, all ranks meet at a barrier, and only then does rank 0 replace
`latest` atomically. A checkpoint without `latest` pointing at it is never resumed from, and is
removed by the next save.

Each checkpoint also holds `stk-run.json`, the run settings it was trained with
(`TrainOptions.run_settings`), read before any model loads so that a resume with another seed,
learning rate or batch is refused in seconds with one line.

Every file of a checkpoint has its size and sha256 in `stk-run.json` (`files`), which is written
last: each rank hashes what it wrote right after writing it (from the page cache), rank 0 gathers
the digests, writes the record, and only then moves `latest`. A resume verifies the checkpoint it
takes, each rank its share of the files, and falls back to the newest one that verifies; a save
that fails on any rank (a full disk, a permission denied) fails on every rank with one line and
exit 69, and `latest` stays where it was.

Its world size may differ from the resuming run's where the effective batch is the same
(stk.train.checkpoint.worldsize): such a checkpoint loads from its universal form.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from stk.cluster.world import World, raised_everywhere
from stk.errors import CheckpointDamaged, InputError, StkError
from stk.log import get_logger
from stk.storage import write_atomic
from stk.storage.failures import disk_error
from stk.train.checkpoint.digests import (
    FILES,
    SETTINGS,
    FileRecord,
    checkpoint_damage,
    has_digests,
    hash_files,
    listed_files,
    read_record,
    recorded_files,
)
from stk.train.checkpoint.worldsize import UNIVERSAL, effective_batch
from stk.train.data.datasets import DATASETS, setting_changes

__all__ = ["CheckpointDir", "Resume"]

log = get_logger("train.checkpoint")

LATEST = "latest"
# Weights of another family, or another adapter (or none), cannot be loaded, whatever the user says.
FIXED_SETTINGS = ("family", "adapter", "dora", "lora_rank", "lora_targets")
# What a record written before the adapter had a kind held: a plain LoRA (compared only when the run trains one).
_BEFORE_ADAPTER_KINDS = {"adapter": "lora", "dora": False}
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
        """The tag `latest` names (which may be missing), or None before the first checkpoint."""
        try:
            with open(os.path.join(self.path, LATEST), encoding="utf-8") as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def resolve(self, resume: str, world: World) -> Resume | None:
        """--resume: "auto" (the newest checkpoint that verifies, or none yet), "none", or a checkpoint directory
        (--resume-from: that one, verified). Collective: each rank verifies its share of the files, rank 0 logs
        what was skipped; CheckpointDamaged (exit 6) when none verifies."""
        if resume == "none":
            return None
        candidates = world.root_call(lambda: self._candidates(resume))
        damaged: list[tuple[Resume, list[str]]] = []
        for candidate in candidates:
            found = [
                line
                for lines in world.allgather(checkpoint_damage(_where(candidate), world.rank, world.size))
                for line in lines
            ]
            if not found:
                world.root_call(partial(_log_taken, candidate, damaged))
                return candidate
            damaged.append((candidate, found))
        if damaged:
            world.root_call(partial(_none_verifies, damaged, resume != "auto"))
        return None

    def _candidates(self, resume: str) -> list[Resume]:
        """The checkpoints to try, newest first."""
        if resume != "auto":
            path = os.path.abspath(resume.rstrip("/"))
            if not os.path.isdir(path):
                raise InputError(f"--resume-from {resume}: no such checkpoint directory (or give --resume auto / none)")
            return [Resume(os.path.dirname(path), os.path.basename(path))]
        tag = self.latest()
        if tag is None:
            return []
        tags = self._tags()[::-1]
        if _TAG.match(tag) and os.path.isdir(os.path.join(self.path, tag)):
            step = int(tag.removeprefix("step-"))
            return [Resume(self.path, name) for s, name in tags if s <= step]
        # `latest` names a folder that is gone: any checkpoint whose record lists its files was complete
        where = f"{self.path}/{LATEST} names {tag!r}, which is not there"
        recorded = [Resume(self.path, name) for _, name in tags if has_digests(os.path.join(self.path, name))]
        if not recorded:
            raise CheckpointDamaged(
                f"{where}, and no other checkpoint lists its files to verify it by: pick one with --resume-from "
                "PATH, or start over with --resume none"
            )
        log.warning("%s: resuming from the newest checkpoint that verifies", where)
        return recorded

    def save(
        self,
        engine: Any,
        step: int,
        client_state: dict[str, Any],
        settings: dict[str, Any],
        also: Callable[[str], list[str]] | None = None,
    ) -> str:
        """Save on every rank; once every rank's files are written and hashed, rank 0 writes stk-run.json with
        `settings` and the digests, moves `latest` and prunes old ones. `also` is called on every rank with the
        checkpoint's folder and returns the files it added there. A failure on any rank (InfraError for a disk:
        exit 69) is raised on every rank, with `latest` where it was."""
        import torch.distributed as dist

        tag = tag_for(step)
        folder = os.path.join(self.path, tag)
        if self.rank == 0:  # a damaged checkpoint of this step, skipped by the resume, or a save that failed
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        files, failure = self._write(engine, tag, client_state, also)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (files, _portable(failure)))
        failed = next(((rank, f) for rank, (_, f) in enumerate(gathered) if f is not None), None)
        if failed is None and self.rank == 0:
            error = self._commit(folder, tag, settings, {name: r for part, _ in gathered for name, r in part.items()})
            failed = None if error is None else (0, error)
        outcome = [failed]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            rank, error = outcome[0]
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)  # frees what the failed save took
            own = failure if rank == self.rank and failure is not None else error
            raise raised_everywhere(own, rank) if isinstance(own, StkError) else own
        return tag

    def _write(
        self, engine: Any, tag: str, client_state: dict[str, Any], also: Callable[[str], list[str]] | None
    ) -> tuple[dict[str, FileRecord], Exception | None]:
        """This rank's files of the checkpoint, written, synced and hashed, or the first failure. Every rank goes
        through every collective of the save, whatever failed on it."""
        import torch.distributed as dist

        folder = os.path.join(self.path, tag)
        recorder = _Recorder(engine.checkpoint_engine)
        engine.checkpoint_engine = recorder
        try:
            engine.save_checkpoint(
                self.path,
                tag=tag,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=self.frozen_base,
            )
        except Exception as exc:  # DeepSpeed's own writes outside its checkpoint engine: rank 0's recovery scripts
            recorder.fail(exc)
            if disk_error(exc, folder, saving=True) is None:
                raise
            dist.barrier()  # the one the other ranks wait in at the end of save_checkpoint
        finally:
            engine.checkpoint_engine = recorder.inner
        written = list(recorder.written)
        try:  # after a failure too: `also` may be collective (LoRA under ZeRO-3)
            written += also(folder) if also is not None else []
        except Exception as exc:
            recorder.fail(exc)
        if recorder.failure is not None:
            return {}, _for_people(recorder.failure, folder)
        try:
            os.sync()  # this rank's files on stable storage before `latest` can point at them
            return hash_files(folder, written, self.rank), None
        except Exception as exc:
            return {}, _for_people(exc, folder)

    def _commit(
        self, folder: str, tag: str, settings: dict[str, Any], files: dict[str, FileRecord]
    ) -> Exception | None:
        """Rank 0: the record (with the files no rank claimed: DeepSpeed's recovery scripts), then `latest`."""
        try:
            files.update(hash_files(folder, listed_files(folder, skip=[*files, SETTINGS]), rank=0))
            record = json.dumps({**settings, FILES: files}, sort_keys=True).encode()
            write_atomic(os.path.join(folder, SETTINGS), record)
            write_atomic(os.path.join(self.path, LATEST), tag.encode())
        except Exception as exc:
            return _for_people(exc, folder)
        self._prune(keep_tag=tag)
        log.info("checkpoint %s saved", folder)
        return None

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
        return {k: v for k, v in (read_record(_where(resume)) or {}).items() if k != FILES}

    def check_settings(self, resume: Resume, current: dict[str, Any], override: bool) -> list[str]:
        """The settings that differ from the checkpoint's ("seed 0 -> 1"); raise InputError unless
        `override` (and always for FIXED_SETTINGS). Another split of the same effective batch is no
        change. Checkpoints without the record are not checked."""
        saved = self.saved_settings(resume)
        saved = {**_BEFORE_ADAPTER_KINDS, DATASETS: [], **saved} if saved else saved
        if saved.get("flow_shift", "") is None:  # recorded when the default was the pipeline's own shift
            saved["flow_shift"] = "auto"
        current = {DATASETS: [], **current}  # a run of one source: no datasets
        changes = {k: setting_changes(k, saved[k], current[k]) for k in current if k in saved}
        changed = [k for k, lines in changes.items() if lines]
        if effective_batch(saved) == effective_batch(current):
            changed = [k for k in changed if k not in SPLIT_SETTINGS]
        if not changed:
            return []
        described = [line for k in changed for line in changes[k]]
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

    def _tags(self) -> list[tuple[int, str]]:
        """(step, tag) of every checkpoint folder, oldest first."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)), name) for name in names if (m := _TAG.match(name)))

    def _prune(self, keep_tag: str) -> None:
        """Keep the newest `keep` complete checkpoints; incomplete ones (newer than `latest`, from a
        killed save) go too."""
        tags = self._tags()
        keep_step = int(keep_tag.removeprefix("step-"))
        complete = [name for step, name in tags if step <= keep_step]
        doomed = complete[: -self.keep] + [name for step, name in tags if step > keep_step]
        for name in doomed:
            shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)


class _Recorder:
    """DeepSpeed's checkpoint engine, recording the files this rank writes and the first failure instead of
    raising it: a rank that raised out of save_checkpoint would leave the others waiting in its barriers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.written: list[str] = []
        self.failure: Exception | None = None

    def fail(self, exc: Exception) -> None:
        if self.failure is None:
            self.failure = exc

    def save(self, state_dict: Any, path: str) -> None:
        if self.failure is not None:
            return
        try:
            self.inner.save(state_dict, path)
            self.written.append(path)
        except Exception as exc:
            self.fail(exc)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except Exception as exc:
            self.fail(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _for_people(exc: Exception, folder: str) -> Exception:
    """A failed save as its one line: any disk failure is exit 69 (storage_errors(saving=True)); others as they
    are (a bug)."""
    named = exc.filename if isinstance(exc, OSError) and exc.filename else None
    return disk_error(exc, os.fsdecode(named) if named else folder, saving=True) or exc


def _portable(exc: Exception | None) -> Exception | None:
    """`exc` as it can travel to the other ranks (pickled): StkErrors as they are, others as their one line."""
    if exc is None or isinstance(exc, StkError):
        return exc
    lines = str(exc).strip().splitlines()
    return RuntimeError(f"{type(exc).__name__}: {lines[0] if lines else ''}")


def _where(resume: Resume) -> str:
    return os.path.join(resume.directory, resume.tag)


def _log_taken(taken: Resume, damaged: list[tuple[Resume, list[str]]]) -> None:
    for resume, found in damaged:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        log.warning("checkpoint %s is damaged, skipped: %s%s", _where(resume), found[0], more)
    if damaged:
        log.warning("resuming from %s, the newest checkpoint that verifies", _where(taken))
    if recorded_files(_where(taken)) is None:
        log.warning(
            "checkpoint %s records no digests (saved by an older stk): resumed without verifying it", _where(taken)
        )


def _none_verifies(damaged: list[tuple[Resume, list[str]]], picked: bool) -> None:
    named = "; ".join(line for _, found in damaged for line in found)
    if picked:
        raise CheckpointDamaged(f"--resume-from: the checkpoint is damaged ({named}); pick another one")
    raise CheckpointDamaged(
        f"no checkpoint verifies ({named}): restore these files, pick a checkpoint with --resume-from, "
        "or start over with --resume none"
    )
