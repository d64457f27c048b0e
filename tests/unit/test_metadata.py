"""Unit tests for stk.metadata: reading tables from stk and other trainers, writing parquet."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stk.errors import InputError
from stk.metadata import read_columns, to_json_lines, write_parquet


@dataclass(frozen=True)
class TableRow:
    """One row of read_columns, as the tests write it."""

    path: str
    caption: str | None
    width: int | None
    height: int | None


def read_rows(location: str, mapping: dict[str, str]) -> list[TableRow]:
    return [TableRow(**row) for row in read_columns(location, mapping).to_pylist()]


def write_jsonl(path: Path, records: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_table(path: Path, records: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def write_as(tmp_path: Path, kind: str, records: list[dict[str, Any]]) -> str:
    if kind == "parquet":
        return write_table(tmp_path / "table.parquet", records)
    return write_jsonl(tmp_path / "table.jsonl", records)


KINDS = ["parquet", "jsonl"]

# (records as another tool writes them, the rows stk reads)
FLAVOURS = {
    "stk": (
        [{"path": "a/1.jpg", "caption": "one", "width": 640, "height": 480}],
        [TableRow("a/1.jpg", "one", 640, 480)],
    ),
    "filename-caption": (
        [
            {"filename": "1.png", "caption": "a cat", "width": 512, "height": 768},
            {"filename": "2.png", "caption": "a dog", "width": 1024, "height": 1024},
        ],
        [TableRow("1.png", "a cat", 512, 768), TableRow("2.png", "a dog", 1024, 1024)],
    ),
    "huggingface-imagefolder": (
        [{"file_name": "train/0001.jpg", "text": "a red car"}, {"file_name": "train/0002.jpg", "text": "a bike"}],
        [TableRow("train/0001.jpg", "a red car", None, None), TableRow("train/0002.jpg", "a bike", None, None)],
    ),
    "image-prompt-w-h": (
        [{"image": "x.webp", "prompt": "sunset", "w": 300, "h": 200}],
        [TableRow("x.webp", "sunset", 300, 200)],
    ),
    "file": ([{"file": "y.gif"}], [TableRow("y.gif", None, None, None)]),
    "image_path-text": (
        [{"image_path": "p/q.bmp", "text": "q", "id": 7}],
        [TableRow("p/q.bmp", "q", None, None)],
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_default_aliases(tmp_path: Path, kind: str, flavour: str) -> None:
    records, expected = FLAVOURS[flavour]
    assert list(read_rows(write_as(tmp_path, kind, records), {})) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_preferred_alias_wins_when_several_are_present(tmp_path: Path, kind: str) -> None:
    records = [{"path": "p.jpg", "filename": "f.jpg", "caption": "c", "text": "t", "prompt": "p"}]
    assert list(read_rows(write_as(tmp_path, kind, records), {})) == [TableRow("p.jpg", "c", None, None)]


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_mapping(tmp_path: Path, kind: str) -> None:
    records = [{"img": "a.jpg", "desc": "first", "path": "ignored.jpg", "cols": 10, "rows": 20}]
    location = write_as(tmp_path, kind, records)
    rows = list(read_rows(location, {"path": "img", "caption": "desc", "width": "cols", "height": "rows"}))
    assert rows == [TableRow("a.jpg", "first", 10, 20)]
    # a partial mapping: the rest found by alias
    assert list(read_rows(location, {"caption": "desc"})) == [TableRow("ignored.jpg", "first", None, None)]


@pytest.mark.parametrize("kind", KINDS)
def test_mapping_to_a_missing_column(tmp_path: Path, kind: str) -> None:
    location = write_as(tmp_path, kind, [{"path": "a.jpg", "caption": "x"}])
    with pytest.raises(InputError, match="--column caption=label"):
        list(read_rows(location, {"caption": "label"}))


@pytest.mark.parametrize("kind", KINDS)
def test_missing_path_column(tmp_path: Path, kind: str) -> None:
    location = write_as(tmp_path, kind, [{"url": "a.jpg", "caption": "x"}])
    with pytest.raises(InputError, match="no path column") as info:
        list(read_rows(location, {}))
    assert "--column path=" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_odd_values(tmp_path: Path, kind: str) -> None:
    records = [
        {"path": "a.jpg", "caption": None, "width": 0, "height": -5},
        {"path": None, "caption": "no path", "width": 10, "height": 20},
        {"path": "c.jpg", "caption": "", "width": None, "height": None},
    ]
    rows = list(read_rows(write_as(tmp_path, kind, records), {}))
    assert rows == [
        TableRow("a.jpg", None, None, None),  # sizes must be positive
        TableRow("", "no path", 10, 20),
        TableRow("c.jpg", "", None, None),  # an empty caption is a caption
    ]


def test_jsonl_values_of_other_types(tmp_path: Path) -> None:
    location = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"path": 17, "caption": 3.5, "width": "640", "height": "tall"},
            {"path": "b.jpg", "caption": "b", "width": 12.0, "height": "0"},
        ],
    )
    rows = list(read_rows(location, {}))
    assert rows == [TableRow("17", "3.5", 640, None), TableRow("b.jpg", "b", 12, None)]


def test_jsonl_rows_with_different_keys(tmp_path: Path) -> None:
    location = write_jsonl(tmp_path / "t.jsonl", [{"file_name": "a.jpg"}, {"file_name": "b.jpg", "text": "b"}])
    assert list(read_rows(location, {})) == [TableRow("a.jpg", None, None, None), TableRow("b.jpg", "b", None, None)]


def test_jsonl_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"path": "a.jpg"}\n   \n\n{"path": "b.jpg"}\n')
    assert [r.path for r in read_rows(str(path), {})] == ["a.jpg", "b.jpg"]


def test_bad_json_line_names_its_number(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"path": "a.jpg"}\n\n{"path": "b.jpg"}\n{"path": "c.jpg",\n{"path": "d.jpg"}\n')
    with pytest.raises(InputError) as info:
        list(read_rows(str(path), {}))
    assert f"{path}:4:" in str(info.value)


@pytest.mark.parametrize("line", ['["a.jpg"]', '"a.jpg"', "42", "null"])
def test_json_line_that_is_not_an_object(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"path": "a.jpg"}\n' + line + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl:2: not a JSON object"):
        list(read_rows(str(path), {}))


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="not a readable parquet file"):
        list(read_rows(str(path), {}))


def test_empty_jsonl_has_no_path_column(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("")
    with pytest.raises(InputError, match="no path column"):
        list(read_rows(str(path), {}))


def test_parquet_round_trip(tmp_path: Path) -> None:
    table = pa.table(
        {
            "path": ["a.jpg", "b/c.png", "d é.webp"],
            "width": pa.array([1, 2, 3], pa.int32()),
            "mtime": [1.5, 2.25, None],
            "caption": ["x", None, "\u732b"],
        }
    )
    location = str(tmp_path / "new" / "dir" / "t.parquet")
    write_parquet(table, location)
    back = pq.read_table(location)
    assert back.equals(table)
    assert back.schema == table.schema
    assert os.listdir(tmp_path / "new" / "dir") == ["t.parquet"]  # no temp file left
    assert pq.ParquetFile(location).metadata.row_group(0).column(0).compression == "ZSTD"


def test_write_parquet_replaces_the_old_table(tmp_path: Path) -> None:
    location = str(tmp_path / "t.parquet")
    write_parquet(pa.table({"path": ["old.jpg"]}), location)
    write_parquet(pa.table({"path": ["new1.jpg", "new2.jpg"]}), location)
    assert pq.read_table(location).column("path").to_pylist() == ["new1.jpg", "new2.jpg"]
    # and stk reads its own table back
    assert [r.path for r in read_rows(location, {})] == ["new1.jpg", "new2.jpg"]


def test_to_json_lines() -> None:
    text = to_json_lines([{"path": "a.jpg", "caption": "caf\u00e9"}, {"path": "b.jpg", "caption": None}])
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 2
    assert [json.loads(line) for line in lines] == [
        {"path": "a.jpg", "caption": "caf\u00e9"},
        {"path": "b.jpg", "caption": None},
    ]
    assert "caf\u00e9" in lines[0]  # not escaped
    assert to_json_lines([]) == ""
