"""Every kind of stk-scan source and output: a tree, JSONL rows on stdout, a stdin list of paths, parquet and JSONL
tables from other trainers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.commands import RunScan, summary_of
from support.scan_outputs import _errors, _no_traceback, _rows, _save_png

from stk.scan.records import JSONL_COLUMNS

pytestmark = pytest.mark.integration


def test_jsonl_rows_on_stdout(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--jsonl", "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    parsed = [json.loads(line) for line in lines]
    table = _rows(out)
    assert len(parsed) == len(table) > 0
    for row, ref in zip(parsed, table, strict=True):
        assert set(row) == set(JSONL_COLUMNS)
        assert {k: row[k] for k in ("path", "width", "height", "caption", "bucket")} == {
            k: ref[k] for k in ("path", "width", "height", "caption", "bucket")
        }
    truth = {m.path: (m.width, m.height) for m in made}
    assert all((row["width"], row["height"]) == truth[row["path"]] for row in parsed)


def test_stdin_list_of_paths(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    chosen = made[:10]
    text = "# picked by hand\n\n" + "".join(f"{root / m.path}\n" for m in chosen)
    out = tmp_path / "out"
    proc = run_scan(["-", "--out", out, "--gpus", "1", "--min-aspect", "0.2", "--max-aspect", "5"], stdin=text)
    assert proc.returncode == 0, proc.stderr
    rows = {r["path"]: r for r in _rows(out)}
    assert set(rows) == {str(root / m.path) for m in chosen}
    for m in chosen:
        row = rows[str(root / m.path)]
        assert (row["width"], row["height"]) == (m.width, m.height)
        if m.caption is not None:  # sidecars are found next to listed files
            assert (row["caption"], row["caption_source"]) == (m.caption, "sidecar")
        else:
            assert row["caption_source"] == "filename"
    assert summary_of(proc)["files"] == 10


def test_parquet_table_from_another_trainer(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "img/a.png", 80, 64)
    _save_png(root / "img/b.png", 96, 64)
    _save_png(root / "img/c.png", 64, 96)
    (root / "img/c.txt").write_text("sidecar for c\n")
    (root / "img/fake.png").write_bytes(b"not an image, but the table knows its size")
    table = pa.table(
        {
            "filename": ["img/a.png", "img/b.png", "img/c.png", "img/fake.png"],
            "caption": ["caption a", "caption b", None, "caption fake"],
            "width": [200, None, None, 120],
            "height": [100, None, None, 100],
        }
    )
    pq.write_table(table, root / "metadata.parquet")
    out = tmp_path / "out"
    proc = run_scan([root / "metadata.parquet", "--out", out, "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    rows = {r["path"]: r for r in _rows(out)}
    assert set(rows) == {"img/a.png", "img/b.png", "img/c.png", "img/fake.png"}
    # rows with a size are not probed: the table's values are kept, even for a non-image
    assert (rows["img/a.png"]["width"], rows["img/a.png"]["height"]) == (200, 100)
    assert (rows["img/fake.png"]["width"], rows["img/fake.png"]["height"]) == (120, 100)
    assert rows["img/a.png"]["format"] is None
    # rows without a size are probed
    assert (rows["img/b.png"]["width"], rows["img/b.png"]["height"], rows["img/b.png"]["format"]) == (96, 64, "PNG")
    assert (rows["img/c.png"]["width"], rows["img/c.png"]["height"]) == (64, 96)
    assert [rows[p]["caption"] for p in ("img/a.png", "img/b.png", "img/c.png")] == [
        "caption a",
        "caption b",
        "sidecar for c",
    ]
    assert rows["img/a.png"]["caption_source"] == "table" and rows["img/c.png"]["caption_source"] == "sidecar"
    assert summary_of(proc)["errors"] == 0

    # --root: the same table kept elsewhere
    elsewhere = tmp_path / "tables" / "meta.parquet"
    elsewhere.parent.mkdir()
    pq.write_table(table, elsewhere)
    proc = run_scan([elsewhere, "--root", root, "--out", tmp_path / "out2", "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    assert _rows(tmp_path / "out2") == _rows(out)


def test_jsonl_table_with_column_mapping(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "one.png", 80, 64)
    _save_png(root / "two.png", 64, 80)
    lines = [
        {"path": "stale/one.png", "file_name": "one.png", "text": "first"},
        {"path": "stale/two.png", "file_name": "two.png", "text": "second"},
    ]
    table = root / "metadata.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in lines))

    mapped = run_scan([table, "--out", tmp_path / "mapped", "--column", "path=file_name", "--gpus", "1"])
    assert mapped.returncode == 0, mapped.stderr
    rows = _rows(tmp_path / "mapped")
    assert [(r["path"], r["width"], r["height"], r["caption"]) for r in rows] == [
        ("one.png", 80, 64, "first"),
        ("two.png", 64, 80, "second"),
    ]
    # without the mapping, the 'path' column wins and names files that do not exist
    unmapped = run_scan([table, "--out", tmp_path / "unmapped", "--gpus", "1", "--max-errors", "10"])
    assert unmapped.returncode == 0, unmapped.stderr
    assert {e["kind"] for e in _errors(tmp_path / "unmapped")} == {"not_found"}
    missing = run_scan([table, "--out", tmp_path / "bad", "--column", "path=nope"])
    assert missing.returncode == 3 and "nope" in missing.stderr
    _no_traceback(missing)
