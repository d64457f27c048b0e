"""stk.shards.scanned: an image is read only while it is the file its scan row describes (size, mtime or ETag, and
the decoded width x height); a file replaced after the scan is refused in one line naming what changed and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stk.datagen import make_image
from stk.images.preprocess import CropMode
from stk.shards.scanned import CHANGED, ChangedSinceScan, SeenFile, read_as_scanned
from stk.storage import FileInfo


def _seen(path: Path, width: int, height: int, etag: str | None = None) -> SeenFile:
    """What stk-scan records of `path`: its mtime as the listing gives it (st_mtime_ns / 1e9)."""
    st = path.stat()
    return SeenFile(st.st_size, st.st_mtime_ns / 1e9, etag, width, height)


def _read(path: Path, seen: SeenFile) -> tuple[int, int]:
    return read_as_scanned(str(path), seen, 64, 48, CropMode.CENTER, "key").original_size


def test_the_scanned_file_is_read(tmp_path: Path) -> None:
    make_image(100, 81).save(tmp_path / "a.png")
    assert _read(tmp_path / "a.png", _seen(tmp_path / "a.png", 100, 81)) == (81, 100)


def test_a_file_replaced_after_the_scan_is_refused_naming_what_changed(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    make_image(100, 81).save(path)
    seen = _seen(path, 100, 81)
    make_image(200, 40, seed=1).save(path)
    with pytest.raises(ChangedSinceScan, match=rf"{seen.bytes} bytes when scanned, now \d+\): run stk-scan again") as e:
        _read(path, seen)
    assert e.value.kind == CHANGED


def test_a_picture_of_another_size_in_a_file_of_the_same_size_and_mtime_is_refused(tmp_path: Path) -> None:
    """What the table says (100 x 81) against what the file decodes to (200 x 40), the file's stat alike."""
    path = tmp_path / "a.png"
    make_image(200, 40).save(path)
    with pytest.raises(ChangedSinceScan, match=r"\(100 x 81 when scanned, now 200 x 40\)"):
        _read(path, _seen(path, 100, 81))


def test_a_touched_file_is_refused_and_the_float_mtime_of_the_same_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    make_image(100, 81).save(path)
    seen = _seen(path, 100, 81)
    as_st_mtime = SeenFile(seen.bytes, path.stat().st_mtime, None, 100, 81)  # a float that may differ in its last bits
    assert _read(path, as_st_mtime) == (81, 100)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 2_000_000_000))
    with pytest.raises(ChangedSinceScan, match="modified since"):
        _read(path, seen)


def test_an_etag_decides_where_both_have_one() -> None:
    """S3: a HEAD's LastModified is rounded to the second where the listing's is not; the ETag tells."""
    seen = SeenFile(10, 1700000000.123, "abc", 4, 4)
    assert seen.file_change(FileInfo("k", "s3://b/k", 10, 1700000000.0, "abc")) is None
    assert seen.file_change(FileInfo("k", "s3://b/k", 10, 1700000000.0, "def")) == "ETag abc when scanned, now def"
    assert seen.file_change(FileInfo("k", "s3://b/k", 11, 1700000000.0, "abc")) == "10 bytes when scanned, now 11"


def test_without_a_record_nothing_is_compared(tmp_path: Path) -> None:
    make_image(100, 81).save(tmp_path / "a.png")
    assert read_as_scanned(str(tmp_path / "a.png"), None, 64, 48, CropMode.CENTER, "key").original_size == (81, 100)
