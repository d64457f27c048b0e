"""Unit tests for stk.scan.candidates: a table's rows as candidate columns."""

from __future__ import annotations

import os

import pyarrow as pa

from stk import storage
from stk.metadata import read_columns
from stk.scan.candidates import from_list, from_table, from_tree, ready, settle
from stk.storage import name_text, text_name


def _table(paths: list[str | None]) -> pa.Table:
    return pa.table(
        {
            "path": pa.array([p if p is not None else "" for p in paths], pa.string()),
            "caption": pa.nulls(len(paths), pa.string()),
            "width": pa.array([64] * len(paths), pa.int32()),
            "height": pa.array([32] * len(paths), pa.int32()),
        }
    )


def test_table_paths_plain_and_odd_are_checked_alike() -> None:
    given = [
        "b/c.jpg",
        "a//b.jpg",
        "./b/c.jpg",
        "a/b.jpg",
        "../up.jpg",
        "/abs.jpg",
        "s3://x/y.jpg",
        "",
        "d\\e.jpg",
        "a/./b.jpg",
        "<empty>",
        "ok/",
    ]
    found = from_table(_table(given), "/root")
    rows = [(r["path"], r["location"], r["error_kind"]) for r in found.to_pylist()]
    assert rows == [
        ("../up.jpg", "/root/../up.jpg", "path_escapes_root"),
        ("/abs.jpg", "/root/abs.jpg", "path_escapes_root"),
        ("<empty>", "/root/<empty>", None),  # a file of that name
        ("<empty>", "/root/", "bad_row"),
        ("a/b.jpg", "/root/a/b.jpg", None),  # a//b.jpg, the first row that normalises to it
        ("a/b.jpg", "/root/a/b.jpg", "duplicate"),  # a/b.jpg
        ("a/b.jpg", "/root/a/b.jpg", "duplicate"),  # a/./b.jpg
        ("b/c.jpg", "/root/b/c.jpg", None),
        ("b/c.jpg", "/root/b/c.jpg", "duplicate"),  # ./b/c.jpg
        ("d/e.jpg", "/root/d/e.jpg", None),  # Windows separators
        ("ok", "/root/ok", None),
        ("s3://x/y.jpg", "/root/s3:/x/y.jpg", "path_escapes_root"),
    ]
    assert found.column("find_sidecar").to_pylist() == [True] * len(given)


def test_a_list_marks_repeats_after_the_first() -> None:
    found = from_list(["b.jpg", "# a comment", "", "a.jpg", " b.jpg "])
    assert [(r["path"], r["error_kind"]) for r in found.to_pylist()] == [
        ("a.jpg", None),
        ("b.jpg", None),
        ("b.jpg", "duplicate"),
    ]


def test_settle_stats_what_is_unknown_and_fingerprints(tmp_path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"x" * 10)
    found = ready(settle(from_table(_table(["a.jpg", "gone.jpg"]), str(tmp_path)), threads=2), "").to_pylist()
    assert [(r["path"], r["size"], r["error_kind"]) for r in found] == [
        ("a.jpg", 10, None),
        ("gone.jpg", -1, "not_found"),
    ]
    assert found[0]["mtime"] > 0
    assert found[0]["fingerprint"] == f"10:{found[0]['mtime']!r}:||None|64|32"  # the table's sizes count too


def test_columns_of_a_parquet_table(tmp_path) -> None:
    location = str(tmp_path / "t.parquet")
    pa.parquet.write_table(pa.table({"file_name": ["a.jpg"], "w": [2.7], "h": [-1]}), location)
    assert read_columns(location, {}).to_pylist() == [{"path": "a.jpg", "caption": None, "width": 2, "height": None}]


def test_a_tree_leaves_out_the_locations_that_ready_puts_back(tmp_path) -> None:
    odd = os.fsdecode(b"c\xff.jpg")  # a name that is not UTF-8: its path and location are escaped alike
    for name in ("a.jpg", "sub/b.png", odd):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * 3)
    found = from_tree(str(tmp_path))
    assert found.column("location").null_count == 3
    done = ready(found, str(tmp_path)).to_pylist()
    listed = sorted(storage.list_files(str(tmp_path)), key=lambda info: name_text(info.key))
    assert [text_name(row["location"]) for row in done] == [info.location for info in listed]
    assert [row["fingerprint"].split("|")[0] for row in done] == [f"3:{info.mtime!r}:" for info in listed]
