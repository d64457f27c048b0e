"""stk-export from options to the written file: what the source holds, whether the format can hold it, then the file,
written beside its place and renamed into it, so `out` is the whole export or nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stk.errors import InputError
from stk.export.adapters import adapter_kind, write_adapter
from stk.export.formats import Format, check_format
from stk.export.single import write_single_file
from stk.export.source import read_source
from stk.export.weights import pipeline_of
from stk.log import get_logger
from stk.models.families import Family
from stk.storage.failures import storage_errors
from stk.storage.modes import honour_umask

__all__ = ["ExportOptions", "export"]

log = get_logger("export")


@dataclass(frozen=True)
class ExportOptions:
    source: str  # OUTPUT/final or a checkpoint folder
    out: str  # the file to write; must not exist
    format: Format = Format.DIFFUSERS
    family: Family | None = None  # where the source does not record it (an adapter's final/ on its own)
    model: str | None = None  # the pipeline a full fine-tune's checkpoint was trained from (its other components)


def export(opts: ExportOptions) -> str:
    """Write `opts.out`; returns its path. InputError (exit 3, one line) for a source that is not stk-train's, a
    format that cannot hold what it holds, or an output that exists."""
    out = Path(opts.out)
    if out.exists():
        raise InputError(f"{opts.out}: already exists; give a new file name (nothing is overwritten)")
    if not out.parent.is_dir():
        raise InputError(f"{opts.out}: its folder {out.parent} does not exist")
    source = read_source(opts.source, opts.family)
    trained = adapter_kind(source.adapter) if source.adapter is not None else "full"
    check_format(trained, opts.format, opts.source)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with storage_errors(opts.out, saving=True):
        try:
            if source.adapter is not None:
                write_adapter(source.adapter, source.family.value, opts.format, tmp)
            else:
                with pipeline_of(source, opts.model, out.parent) as pipeline:
                    write_single_file(pipeline, source.family.value, tmp)
            honour_umask(tmp)  # safetensors writes 0600: an export on shared storage is for the team
            tmp.rename(out)
        finally:
            tmp.unlink(missing_ok=True)
    log.info("%s (%s, %s): %s", opts.source, source.family.value, opts.format.value, opts.out)
    return opts.out
