"""Look at one candidate (a row of stk.scan.candidates): header-only size and orientation, and its caption."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stk import storage
from stk.captions import (
    CAPTION_EXTENSIONS,
    CaptionError,
    CaptionSource,
    MissingCaption,
    caption_from_filename,
    caption_from_stem,
    decode_caption,
)
from stk.errors import StkError, described
from stk.images.formats import ACCEPTED
from stk.images.headers import MetadataWarning
from stk.images.info import ImageError, read_header
from stk.scan.records import Record, error_record
from stk.scan.sidecars import Sidecars

__all__ = ["ProbeOptions", "probe"]


@dataclass(frozen=True)
class ProbeOptions:
    max_pixels: int | None = 178_956_970
    missing_caption: MissingCaption = MissingCaption.FILENAME
    formats: frozenset[str] = field(default=ACCEPTED)  # Pillow format names (--formats)
    captions: CaptionSource = CaptionSource.SIDECAR  # a dataset's own (stk.datasets.DatasetSpec)
    sidecars: tuple[str, ...] = CAPTION_EXTENSIONS  # the sidecar extensions looked for, the first preferred

    def settings_key(self) -> str:
        """Records made under other settings, or by a reader that knew fewer formats, would
        differ: they are not reused. The caption settings are named only where not the default, so a scan
        made before they existed is reused."""
        formats = ",".join(sorted(self.formats))
        key = f"max_pixels={self.max_pixels};missing_caption={self.missing_caption.value};formats={formats}"
        if self.captions is not CaptionSource.SIDECAR:
            key += f";captions={self.captions.value}"
        if self.sidecars != CAPTION_EXTENSIONS:
            key += f";sidecars={','.join(self.sidecars)}"
        return key


Candidate = Mapping[str, Any]  # a row of stk.scan.candidates.CANDIDATE_SCHEMA, with its fingerprint


def _caption(cand: Candidate, image: str, opts: ProbeOptions, sidecars: Sidecars | None) -> tuple[str, str]:
    """(caption, source); raises CaptionError when none may be used."""
    if opts.captions is CaptionSource.STEM:
        return caption_from_stem(cand["path"]), "filename"
    if cand["caption"] is not None:
        return cand["caption"], "table"
    if cand["caption_location"]:
        location: str | None = storage.text_name(cand["caption_location"])
    else:
        location = (sidecars or Sidecars(opts.sidecars)).find(image) if cand["find_sidecar"] else None
    if location is not None:
        try:
            return decode_caption(storage.read_bytes(location)), "sidecar"
        except storage.NotAFileError as exc:
            raise CaptionError(f"caption {exc}", kind="not_a_file") from exc
        except OSError as exc:
            raise CaptionError(f"cannot read caption {location}: {exc.strerror or exc}") from exc
    if opts.missing_caption is MissingCaption.EMPTY:
        return "", "empty"
    if opts.missing_caption is MissingCaption.FILENAME:
        return caption_from_filename(cand["path"]), "filename"
    raise CaptionError(
        f"no caption (no table column, no {'/'.join(opts.sidecars)} sidecar) and --missing-caption error",
        kind="caption_missing",
    )


def _size(cand: Candidate, location: str, opts: ProbeOptions) -> tuple[int, int, str | None, MetadataWarning | None]:
    """Width, height, format and any metadata warning: from the table, or from the file's header."""
    if cand["width"] and cand["height"]:
        return cand["width"], cand["height"], None, None
    with storage.open_read(location, cand["size"]) as f:
        header = read_header(f, cand["size"], opts.max_pixels, opts.formats, cand["path"])
    return header.width, header.height, header.format, header.warning


def _failure(exc: Exception) -> tuple[str, str]:
    """The error row's kind and reason for whatever looking at one file raised."""
    if isinstance(exc, ImageError):
        return exc.kind, exc.reason
    if isinstance(exc, CaptionError):
        return exc.kind, str(exc)
    if isinstance(exc, storage.NotAFileError):
        return "not_a_file", str(exc)
    if isinstance(exc, FileNotFoundError):
        return "not_found", "file disappeared during the scan"
    if isinstance(exc, OSError):
        return "unreadable", f"cannot read: {exc.strerror or exc}"
    return "unreadable", f"cannot read: {described(exc)}"


def probe(cand: Candidate, opts: ProbeOptions, sidecars: Sidecars | None = None) -> Record:
    """A record for `cand`; whatever fails for this one file becomes its error record, never an
    exception. Only a failure of the storage itself (InfraError: S3 down past its budget) ends the scan.
    `sidecars`: the listings of its block's directories (stk.scan.sidecars), else each name is asked for."""
    fp, location, path = cand["fingerprint"], cand["location"], cand["path"]
    if cand["error_kind"]:
        return error_record(path, location, fp, cand["error_kind"], cand["error"] or cand["error_kind"])
    name = storage.text_name(location)  # the name that opens the file
    try:
        width, height, fmt, warning = _size(cand, name, opts)
        caption, source = _caption(cand, name, opts, sidecars)
    except StkError:
        raise
    except Exception as exc:
        return error_record(path, location, fp, *_failure(exc))
    return {
        "path": path,
        "location": location,
        "width": width,
        "height": height,
        "format": fmt,
        "bytes": cand["size"],
        "mtime": cand["mtime"],
        "etag": cand["etag"],
        "caption": caption,
        "caption_source": source,
        "fingerprint": fp,
        "kind": None,
        "reason": None,
        "warning_kind": warning.kind if warning else None,
        "warning": warning.reason if warning else None,
    }
