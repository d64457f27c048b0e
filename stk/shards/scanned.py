"""An image read as stk-scan saw it, or refused: a file replaced after the scan keeps its row's key, bucket and crop,
so encoding it would store another picture under that key (a 200 x 40 picture where the table says 100 x 81), and
stk-train would train on it, silently. stk-cache makes such a file an error row (`changed_since_scan`, held against
--max-errors like any bad input); stk-train --vae-on-the-fly ends with it, one line, exit 3. Both name the fix: scan
again, which rescans changed files and keys them anew."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from stk import storage
from stk.images.preprocess import CropMode, Preprocessed, PreprocessError, preprocess
from stk.storage import FileInfo

__all__ = ["CHANGED", "SEEN_COLUMNS", "ChangedSinceScan", "SeenFile", "read_as_scanned", "seen_files"]

CHANGED = "changed_since_scan"  # the error row's kind
SEEN_COLUMNS = ["bytes", "mtime", "etag", "width", "height"]  # what a scan row records of its file
# mtimes as the scan and a later stat give them can differ in the last bits of a float (st_mtime against
# st_mtime_ns / 1e9): a microsecond is far above that and far below any replacement
_MTIME_SLACK = 1e-6


class ChangedSinceScan(PreprocessError):
    """The file is not the one its scan row describes."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=CHANGED)


@dataclass(frozen=True)
class SeenFile:
    """A scan row's record of its file: size, mtime, ETag (S3), and the image's width and height after EXIF
    orientation; None where the table has no such column or value (nothing is compared there)."""

    bytes: int | None
    mtime: float | None
    etag: str | None = None
    width: int | None = None
    height: int | None = None

    def file_change(self, info: FileInfo) -> str | None:
        """How the file now differs from the scan's record of it; None: it does not. An ETag decides where both
        have one (S3: a HEAD's LastModified is rounded to the second, the listing's is not); else the mtime."""
        if self.bytes is not None and info.size != self.bytes:
            return f"{self.bytes} bytes when scanned, now {info.size}"
        if self.etag and info.etag:
            return None if self.etag == info.etag else f"ETag {self.etag} when scanned, now {info.etag}"
        if self.mtime is not None and abs(info.mtime - self.mtime) > _MTIME_SLACK:
            return f"modified since: mtime {self.mtime:.6f} when scanned, now {info.mtime:.6f}"
        return None

    def size_change(self, original_size: tuple[int, int]) -> str | None:
        """How the decoded image's (height, width) differs from the scan's width x height; None: it does not."""
        height, width = original_size
        if self.width is None or self.height is None or (width, height) == (self.width, self.height):
            return None
        return f"{self.width} x {self.height} when scanned, now {width} x {height}"


def seen_files(table: pa.Table) -> list[SeenFile]:
    """The SeenFile of each row of a table holding some of SEEN_COLUMNS (bytes and mtime at least: JOB_COLUMNS)."""
    return [SeenFile(**row) for row in table.select([c for c in SEEN_COLUMNS if c in table.column_names]).to_pylist()]


def read_as_scanned(
    location: str, seen: SeenFile | None, bucket_width: int, bucket_height: int, crop: CropMode, seed: str
) -> Preprocessed:
    """The image at `location` fitted to its bucket (stk.images.preprocess), refused with ChangedSinceScan when it is
    not what `seen` records. The stat is the one a read needs anyway on S3 (the object's size); a non-file is left to
    open_read to refuse."""
    info = storage.stat(location)
    change = seen.file_change(info) if seen is not None and info.error is None else None
    if change is None:
        with storage.open_read(location, info.size if info.error is None else None) as f:
            item = preprocess(f, bucket_width, bucket_height, crop, seed)
        change = seen.size_change(item.original_size) if seen is not None else None
        if change is None:
            return item
    raise ChangedSinceScan(f"changed since stk-scan read it ({change}): run stk-scan again (it rescans changed files)")
