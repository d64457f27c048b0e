"""stk-export from options to the written file: what the source holds, whether the format can hold it, then the file,
built in a scratch folder beside its place and renamed into it, so `out` is the whole export or nothing.

The scratch folder is named from `out` (`.NAME.stk-export`): a killed export leaves it (for a full fine-tune's
checkpoint, a whole pipeline), and the next export to the same `out` removes it first; a failed one removes its own."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from stk.errors import InputError
from stk.export.adapters import read_adapter, write_adapter
from stk.export.formats import Format, check_format
from stk.export.single import write_single_file
from stk.export.source import read_source
from stk.export.weights import pipeline_of
from stk.log import get_logger
from stk.models.families import Family
from stk.storage.failures import storage_errors
from stk.storage.modes import honour_umask

__all__ = ["ExportOptions", "export", "scratch_of"]

log = get_logger("export")


@dataclass(frozen=True)
class ExportOptions:
    source: str  # OUTPUT/final or a checkpoint folder
    out: str  # the file to write; must not exist
    format: Format = Format.DIFFUSERS
    family: Family | None = None  # where the source does not record it (an adapter's final/ on its own)
    model: str | None = None  # the pipeline a full fine-tune's checkpoint was trained from (its other components)


def scratch_of(out: Path) -> Path:
    """The folder an export to `out` builds in: beside it (one file system, so the rename is atomic), named from it."""
    return out.with_name(f".{out.name}.stk-export")


def export(opts: ExportOptions) -> str:
    """Write `opts.out`; returns its path. InputError (exit 3, one line) for a source that is not stk-train's, a
    format that cannot hold what it holds, or an output that exists; CheckpointDamaged (exit 6) for a source that does
    not verify or cannot be read; InfraError (exit 69) for a disk that fails."""
    out = Path(opts.out)
    if not out.parent.is_dir():
        raise InputError(f"{opts.out}: its folder {out.parent} does not exist")
    scratch = scratch_of(out)
    with storage_errors(str(scratch), saving=True):
        if scratch.exists():
            log.info("%s: removing what an export that did not finish left there", scratch)
            shutil.rmtree(scratch)
    if out.exists():
        raise InputError(f"{opts.out}: already exists; give a new file name (nothing is overwritten)")
    source = read_source(opts.source, opts.family)
    adapter = read_adapter(source.adapter) if source.adapter is not None else None
    check_format(adapter.kind if adapter is not None else "full", opts.format, opts.source)
    with storage_errors(opts.out, saving=True):
        try:
            scratch.mkdir()
            tmp = scratch / out.name
            if adapter is not None:
                write_adapter(adapter, source.family.value, opts.format, tmp)
            else:
                write_single_file(pipeline_of(source, opts.model, scratch), source.family.value, tmp)
            honour_umask(tmp)  # safetensors writes 0600: an export on shared storage is for the team
            tmp.rename(out)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    log.info("%s (%s, %s): %s", opts.source, source.family.value, opts.format.value, opts.out)
    return opts.out
