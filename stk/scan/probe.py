"""Look at one candidate: header-only size and orientation, and its caption."""

from __future__ import annotations

from dataclasses import dataclass, field

from stk import storage
from stk.captions import (
    CAPTION_EXTENSIONS,
    CaptionError,
    MissingCaption,
    caption_from_filename,
    decode_caption,
    sidecar_stem,
)
from stk.imageformats import ACCEPTED
from stk.imageinfo import ImageError, read_header
from stk.scan.candidates import Candidate
from stk.scan.records import Record, error_record

__all__ = ["ProbeOptions", "probe"]


@dataclass(frozen=True)
class ProbeOptions:
    max_pixels: int | None = 178_956_970
    missing_caption: MissingCaption = MissingCaption.FILENAME
    formats: frozenset[str] = field(default=ACCEPTED)  # Pillow format names (--formats)

    def settings_key(self) -> str:
        """Records made under other settings, or by a reader that knew fewer formats, would
        differ: they are not reused."""
        formats = ",".join(sorted(self.formats))
        return f"max_pixels={self.max_pixels};missing_caption={self.missing_caption.value};formats={formats}"


def _find_sidecar(location: str) -> str | None:
    stem = sidecar_stem(location)
    for ext in CAPTION_EXTENSIONS:
        if storage.exists(stem + ext):
            return stem + ext
    return None


def _caption(cand: Candidate, opts: ProbeOptions) -> tuple[str, str]:
    """(caption, source); raises CaptionError when none may be used."""
    if cand.caption is not None:
        return cand.caption, "table"
    location = cand.caption_location or (_find_sidecar(cand.location) if cand.find_sidecar else None)
    if location is not None:
        try:
            return decode_caption(storage.read_bytes(location)), "sidecar"
        except OSError as exc:
            raise CaptionError(f"cannot read caption {location}: {exc.strerror or exc}") from exc
    if opts.missing_caption is MissingCaption.EMPTY:
        return "", "empty"
    if opts.missing_caption is MissingCaption.FILENAME:
        return caption_from_filename(cand.path), "filename"
    raise CaptionError("no caption (no table column, no .txt/.caption sidecar) and --missing-caption error")


def probe(cand: Candidate, opts: ProbeOptions) -> Record:
    """A record for `cand`; every failure becomes an error record, never an exception."""
    fp = cand.fingerprint
    if cand.error_kind:
        return error_record(cand.path, cand.location, fp, cand.error_kind, cand.error or cand.error_kind)
    try:
        if cand.width and cand.height:
            width, height, fmt, warning = cand.width, cand.height, None, None
        else:
            with storage.open_read(cand.location, cand.size) as f:
                header = read_header(f, cand.size, opts.max_pixels, opts.formats, cand.path)
            width, height, fmt, warning = header.width, header.height, header.format, header.warning
    except ImageError as exc:
        return error_record(cand.path, cand.location, fp, exc.kind, exc.reason)
    except FileNotFoundError:
        return error_record(cand.path, cand.location, fp, "not_found", "file disappeared during the scan")
    except IsADirectoryError:
        return error_record(cand.path, cand.location, fp, "unreadable", "is a directory")
    except OSError as exc:
        return error_record(cand.path, cand.location, fp, "unreadable", f"cannot read: {exc.strerror or exc}")
    try:
        caption, source = _caption(cand, opts)
    except CaptionError as exc:
        kind = "caption_missing" if "no caption" in str(exc) else "caption_unreadable"
        return error_record(cand.path, cand.location, fp, kind, str(exc))
    return {
        "path": cand.path,
        "location": cand.location,
        "width": width,
        "height": height,
        "format": fmt,
        "bytes": cand.size,
        "mtime": cand.mtime,
        "etag": cand.etag,
        "caption": caption,
        "caption_source": source,
        "fingerprint": fp,
        "kind": None,
        "reason": None,
        "warning_kind": warning.kind if warning else None,
        "warning": warning.reason if warning else None,
    }
