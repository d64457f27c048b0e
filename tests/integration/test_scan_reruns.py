"""stk-scan's incremental reruns: a local rerun reuses what it scanned, bad and filtered files are remembered until
the settings change, and a damaged state file costs a rescan, not the scan."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.commands import RunScan, summary_of
from support.scan_outputs import BAD_ARGS, _rows, _save_png

from stk.datagen import generate_dataset

pytestmark = pytest.mark.integration


def test_incremental_local_rerun_and_full(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    made = generate_dataset(str(root), count=20, seed=11, min_side=64, max_side=120)  # nothing filtered
    out = tmp_path / "out"
    args = [root, "--out", out, "--gpus", "1"]
    first = summary_of(run_scan(args))
    assert (first["files"], first["scanned"], first["reused"], first["images"]) == (20, 20, 0, 20)
    second = summary_of(run_scan(args))
    assert (second["scanned"], second["reused"]) == (0, 20)
    before = {r["path"]: r for r in _rows(out)}

    touched, removed = made[2].path, made[5].path
    st = os.stat(root / touched)
    os.utime(root / touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    os.remove(root / removed)
    _save_png(root / "landscapes/new_one.png", 100, 80)

    proc = run_scan(args)
    assert proc.returncode == 0, proc.stderr
    third = summary_of(proc)
    assert (third["files"], third["scanned"], third["reused"]) == (20, 2, 18)
    after = {r["path"]: r for r in _rows(out)}
    assert removed not in after
    assert (after["landscapes/new_one.png"]["width"], after["landscapes/new_one.png"]["height"]) == (100, 80)
    assert after[touched]["mtime"] == pytest.approx(before[touched]["mtime"] + 5)
    assert after[touched]["fingerprint"] != before[touched]["fingerprint"]
    for path in set(after) - {touched, "landscapes/new_one.png"}:
        assert after[path] == before[path]

    # a changed caption sidecar rescans its image only
    captioned = next(m for m in made if m.caption is not None and m.path not in (touched, removed))
    stem = (root / captioned.path).with_suffix("")
    sidecar = next(p for p in (stem.with_suffix(".txt"), stem.with_suffix(".caption")) if p.exists())
    sidecar.write_text("a brand new caption\n")
    os.utime(sidecar, ns=(st.st_atime_ns, st.st_mtime_ns + 9_000_000_000))
    fourth = summary_of(run_scan(args))
    assert (fourth["scanned"], fourth["reused"]) == (1, 19)
    assert {r["path"]: r for r in _rows(out)}[captioned.path]["caption"] == "a brand new caption"

    full = summary_of(run_scan([*args, "--full"]))
    assert (full["files"], full["scanned"], full["reused"]) == (20, 20, 0)
    assert {r["path"]: r["width"] for r in _rows(out)} == {p: r["width"] for p, r in after.items()}


def test_rerun_reuses_bad_and_filtered_files_unless_the_settings_change(
    corpus: tuple[Path, dict[str, str]], run_scan: RunScan, tmp_path: Path
):
    root, expected = corpus
    _save_png(root / "small.png", 20, 16)  # filtered by --min-size below
    (root / "small.txt").write_text("small\n")
    out = tmp_path / "out"
    args = [root, "--out", out, *BAD_ARGS, "--max-errors", "1000", "--min-size", "32"]
    first = summary_of(run_scan(args))
    assert first["skipped"] == 1 and first["errors"] == len(expected)

    again = summary_of(run_scan(args))
    # only the broken symlink is looked at again: it is caught while listing, not reused
    assert again["scanned"] == 1 and again["reused"] == first["files"] - 1
    assert again["error_kinds"] == first["error_kinds"] and again["skipped"] == 1
    assert (out / "errors.jsonl").read_text() == _errors_text(run_scan, args, tmp_path)

    # another --max-pixels could change every result: nothing is reused
    looser = summary_of(run_scan([*args, "--max-pixels", "1000000"]))
    assert looser["reused"] == 0 and looser["scanned"] == first["files"]
    assert "too_many_pixels" not in looser["error_kinds"]


def _errors_text(run_scan: RunScan, args: list[Any], tmp_path: Path) -> str:
    """errors.jsonl of a clean scan with the same arguments, in a fresh directory."""
    fresh = tmp_path / "fresh"
    run_scan([args[0], "--out", fresh, *args[3:]])
    return (fresh / "errors.jsonl").read_text()


def test_a_damaged_state_file_costs_a_rescan_not_the_scan(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    out = tmp_path / "out"
    assert run_scan([root, "--out", out, "--allow-oversubscription"]).returncode == 0
    rows = (out / "metadata.parquet").read_bytes()
    (out / ".scan-state.parquet").write_bytes(b"PAR1 not really parquet")
    proc = run_scan([root, "--out", out, "--allow-oversubscription"])
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["scanned"] == len(made)
    assert pq.read_table(io.BytesIO(rows)).equals(pq.read_table(out / "metadata.parquet"))
