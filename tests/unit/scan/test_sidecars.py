"""Unit tests for stk.scan.sidecars: sidecar captions found from one listing per directory give the records that
asking for each name gives, with no exists() for a listed directory, and fall back to asking where listing does not
pay or fails."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from stk import storage
from stk.datagen import make_image
from stk.scan import sidecars
from stk.scan.candidates import from_list, ready, settle
from stk.scan.probe import ProbeOptions, probe
from stk.scan.records import Record


def _tree(root: Path) -> list[str]:
    """a/ with six images and every kind of sidecar (listed), b/ with one (asked name by name); their paths."""
    for directory, count in (("a", 6), ("b", 1)):
        (root / directory).mkdir()
        for i in range(count):
            make_image(8, 8, seed=i).save(root / directory / f"img{i}.png")
    (root / "a/img0.txt").write_text("zero\n")
    (root / "a/img1.caption").write_text("one\n")
    (root / "a/img2.txt").write_text("two, preferred\n")
    (root / "a/img2.caption").write_text("two, not preferred\n")
    (root / "a/img3.txt").mkdir()  # a directory where the caption should be
    os.symlink(root / "nowhere", root / "a/img4.txt")  # a broken link: exists() sees nothing
    (root / "b/img0.txt").write_text("b zero\n")
    return sorted(str(p) for p in root.rglob("*.png"))


def _records(table: pa.Table, found: sidecars.Sidecars | None, opts: ProbeOptions | None = None) -> list[Record]:
    return [probe(cand, opts or ProbeOptions(), *([found] if found else [])) for cand in table.to_pylist()]


def _asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    asked: list[str] = []
    exists = storage.exists

    def counting(location: str) -> bool:
        asked.append(location)
        return exists(location)

    monkeypatch.setattr(storage, "exists", counting)
    return asked


def test_one_listing_per_directory_gives_the_same_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = ready(settle(from_list(_tree(tmp_path)), threads=1), "")
    asked = _asked(monkeypatch)
    one_by_one = _records(table, None)
    assert len(asked) == 10  # one per image with a .txt (or a directory of that name), else two
    asked.clear()
    with ThreadPoolExecutor(2) as pool:
        listed = _records(table, sidecars.listed_for(table, pool))
    assert listed == one_by_one
    assert asked == [str(tmp_path / "b/img0.txt")]  # b/ holds too few images to list
    got = {os.path.relpath(r["path"], tmp_path): (r["caption"], r["caption_source"], r["kind"]) for r in listed}
    assert got == {
        "a/img0.png": ("zero", "sidecar", None),
        "a/img1.png": ("one", "sidecar", None),
        "a/img2.png": ("two, preferred", "sidecar", None),
        "a/img3.png": (None, None, "not_a_file"),
        "a/img4.png": ("img4", "filename", None),
        "a/img5.png": ("img5", "filename", None),
        "b/img0.png": ("b zero", "sidecar", None),
    }


def test_a_datasets_own_extension_is_the_only_sidecar_read(tmp_path: Path) -> None:
    """kohya's caption_extension (here its default, .caption): a .txt beside the image is no caption."""
    table = ready(settle(from_list(_tree(tmp_path)), threads=1), "")
    opts = ProbeOptions(sidecars=(".caption",))
    one_by_one = _records(table, None, opts)
    with ThreadPoolExecutor(2) as pool:
        listed = _records(table, sidecars.listed_for(table, pool, opts.sidecars), opts)
    assert listed == one_by_one
    got = {os.path.relpath(r["path"], tmp_path): (r["caption"], r["caption_source"]) for r in listed}
    assert got == {
        "a/img0.png": ("img0", "filename"),
        "a/img1.png": ("one", "sidecar"),
        "a/img2.png": ("two, not preferred", "sidecar"),
        "a/img3.png": ("img3", "filename"),  # the directory img3.txt is no .caption either
        "a/img4.png": ("img4", "filename"),
        "a/img5.png": ("img5", "filename"),
        "b/img0.png": ("img0", "filename"),
    }


def test_a_caption_gone_after_the_listing_is_an_unreadable_caption(tmp_path: Path) -> None:
    table = ready(settle(from_list(_tree(tmp_path)), threads=1), "")
    with ThreadPoolExecutor(2) as pool:
        found = sidecars.listed_for(table, pool)
    (tmp_path / "a/img0.txt").unlink()
    (record,) = _records(table.slice(0, 1), found)
    assert record["kind"] == "caption_unreadable", record
    assert record["reason"] == f"cannot read caption {tmp_path}/a/img0.txt: No such file or directory"


def _too_big(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sidecars, "ENTRIES_PER_IMAGE", 1)
    monkeypatch.setattr(sidecars, "SLACK", 0)


def _unlistable(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(directory: str) -> Any:
        raise PermissionError(13, "Permission denied", directory)

    monkeypatch.setattr(storage, "names", refused)


@pytest.mark.parametrize("why", [_too_big, _unlistable], ids=["too_many_entries", "cannot_list"])
def test_a_directory_not_worth_or_not_open_to_listing_is_asked_name_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: Any
) -> None:
    table = ready(settle(from_list(_tree(tmp_path)), threads=1), "")
    one_by_one = _records(table, None)
    why(monkeypatch)
    asked = _asked(monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        assert _records(table, sidecars.listed_for(table, pool)) == one_by_one
    assert len(asked) == 10
