"""Resuming a checkpoint on another number of ranks: after a node dies, a job is requeued on the nodes left.

Three things change with the world size, and each is kept:
- the effective batch (ranks x --batch-size x --grad-accum): the gradient accumulation is recomputed from the
  checkpoint's, so 2 ranks x batch 2 resume as 1 rank x batch 2 x accumulation 2; where no accumulation makes it,
  the run is refused before any model loads (`--override-resume` continues with the new effective batch);
- the ZeRO partitions of the weights and the optimizer state: DeepSpeed loads them on another world size only from
  its universal checkpoint, a folder per weight, which `universal_checkpoint` converts once into the checkpoint's
  `universal/` (rank 0, before the rendezvous; a later resume reuses it);
- the sample order and the EMA need nothing here: the sampler's position is counted in samples
  (stk.train.data.sampler), and the EMA gathers its shares from the saved ones (stk.train.trainable.ema).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import tempfile
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from stk.errors import InputError
from stk.log import get_logger
from stk.storage.failures import storage_errors

__all__ = ["UNIVERSAL", "accumulation_for", "effective_batch", "universal_checkpoint"]

log = get_logger("train.worldsize")

UNIVERSAL = "universal"  # the converted checkpoint, inside the checkpoint's folder
_PARTIAL = ".universal-"  # a conversion under way (or killed): renamed to UNIVERSAL when complete


def effective_batch(settings: Mapping[str, Any]) -> int | None:
    """Samples per optimizer step of a run's settings (TrainOptions.run_settings); None where the world size was
    not recorded."""
    if "world_size" not in settings:
        return None
    return int(settings["world_size"] * settings["batch_size"] * settings["grad_accum"])


def accumulation_for(
    saved: Mapping[str, Any], batch_size: int, grad_accum: int, world_size: int, where: str, override: bool
) -> int:
    """The --grad-accum that keeps the effective batch `saved` (a checkpoint's settings) was trained with on
    `world_size` ranks of `batch_size`; `grad_accum` (as given) on the world size it was saved on. Raises
    InputError, naming the world sizes that keep it, where none does, unless `override`."""
    before = saved.get("world_size")
    effective = effective_batch(saved)
    if before is None or effective is None or before == world_size:
        return grad_accum
    if saved.get("optimizer") == "lion":  # ds_to_universal converts Adam's two moments only
        raise InputError(
            f"{where} was trained with Lion on {_ranks(before)}: its optimizer state cannot be re-sharded to "
            f"{world_size}; resume on {_ranks(before)}"
        )
    if effective % (batch_size * world_size) == 0:
        accum = effective // (batch_size * world_size)
        log.info(
            "%s: saved on %s, resumed on %d: gradient accumulation %d keeps the effective batch of %d",
            where,
            _ranks(before),
            world_size,
            accum,
            effective,
        )
        return accum
    fits = [n for n in range(1, effective // batch_size + 1) if effective % (batch_size * n) == 0]
    keeps = (
        f"resume on {_ranks(fits[-1], fits[:-1])} at --batch-size {batch_size}"
        if fits
        else f"resume with --batch-size {saved['batch_size']}"
    )
    new = batch_size * grad_accum * world_size
    message = (
        f"{where} was trained with an effective batch of {effective} ({_ranks(before)} x --batch-size "
        f"{saved['batch_size']} x --grad-accum {saved['grad_accum']}), which {_ranks(world_size)} x --batch-size "
        f"{batch_size} cannot make: {keeps}, or add --override-resume to continue with an effective batch of {new}"
    )
    if not override:
        raise InputError(message)
    log.warning(
        "--override-resume: %s continues on %s with an effective batch of %d (was %d)",
        where,
        _ranks(world_size),
        new,
        effective,
    )
    return grad_accum


def _ranks(count: int, before: list[int] | None = None) -> str:
    """ "2 ranks"; with `before`, a choice: "1, 2 or 4 ranks"."""
    head = f"{', '.join(map(str, before))} or " if before else ""
    return f"{head}{count} rank{'s' if count != 1 or before else ''}"


def universal_checkpoint(folder: str) -> str:
    """`folder` (a DeepSpeed ZeRO checkpoint) as DeepSpeed's universal checkpoint in `folder`/universal, which
    loads on any number of ranks. Converted once, into a temporary folder renamed when complete (a killed
    conversion's is removed); an existing one is reused. One process (rank 0), before the rendezvous: it reads
    every rank's files."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = os.path.join(folder, UNIVERSAL)
    if os.path.isdir(target):
        log.info("%s: reusing its universal checkpoint", folder)
        return target
    with storage_errors(folder):
        for stale in glob.glob(os.path.join(folder, _PARTIAL + "*")):
            shutil.rmtree(stale)
            log.info("removed %s, a conversion that did not finish", stale)
        work = tempfile.mkdtemp(prefix=_PARTIAL, dir=folder)
        try:
            args = SimpleNamespace(
                input_folder=folder,
                output_folder=os.path.join(work, UNIVERSAL),  # its `latest_universal` lands in `work`, dropped
                num_extract_workers=1,  # no process pool inside an MPI rank
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,  # DeepSpeed records no universal info for a plain module
            )
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                ds_to_universal(args)  # its progress prints and bars
            os.rename(args.output_folder, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("%s: converted to a universal checkpoint for another number of ranks (%s)", folder, target)
    return target
