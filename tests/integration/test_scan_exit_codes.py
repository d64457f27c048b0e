"""stk-scan's documented exit codes (too many errors, a failed batch check, a missing source, a bad option), and
--help and the environment variables it lists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support.commands import RunScan, summary_of
from support.scan_outputs import BAD_ARGS, GOOD, _errors, _no_traceback, _rows

pytestmark = pytest.mark.integration


def _buckets(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "buckets.json").read_text())
    return doc


def test_too_many_errors_exits_4_with_outputs_written(
    corpus: tuple[Path, dict[str, str]], run_scan: RunScan, tmp_path: Path
):
    root, expected = corpus
    faults = len(expected)
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, *BAD_ARGS])  # default --max-errors 1%
    assert proc.returncode == 4, proc.stderr
    _no_traceback(proc)
    assert "--max-errors" in proc.stderr and "errors.jsonl" in proc.stderr
    assert len(_errors(out)) == faults
    assert [r["path"] for r in _rows(out)] == GOOD
    assert _buckets(out)["buckets"]
    assert json.loads((out / "summary.json").read_text())["errors"] == faults

    # the limit is inclusive: exactly as many faults as allowed passes, one fewer fails
    at_limit = run_scan([root, "--out", tmp_path / "at", *BAD_ARGS, "--max-errors", str(faults)])
    assert at_limit.returncode == 0, at_limit.stderr
    below = run_scan([root, "--out", tmp_path / "below", *BAD_ARGS, "--max-errors", str(faults - 1)])
    assert below.returncode == 4, below.stderr
    percent = run_scan([root, "--out", tmp_path / "pct", *BAD_ARGS, "--max-errors", "90%"])
    assert percent.returncode == 0, percent.stderr


def test_batch_check_failure_exits_5_and_lists_short_buckets(
    dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path
):
    root, _ = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--batch-size", "4", "--gpus", "1"])
    assert proc.returncode == 5, proc.stderr
    _no_traceback(proc)
    doc = _buckets(out)
    short = doc["short_buckets"]
    assert short and doc["batch_check_ok"] is False and doc["oversubscribed"] is False
    needs = [line for line in proc.stderr.splitlines() if "needs --repeats >=" in line]
    assert len(needs) == len(short)
    for s in short:
        bucket = next(b for b in doc["buckets"] if b["id"] == s["id"])
        line = f"bucket {s['id']} ({bucket['width']}x{bucket['height']}): {s['count']} images"
        assert any(line in n and f"--repeats >= {s['min_repeats']}" in n for n in needs), (line, needs)
    assert "--allow-oversubscription" in proc.stderr
    assert (out / "metadata.parquet").exists() and (out / "errors.jsonl").exists()
    assert json.loads((out / "summary.json").read_text())["short_buckets"] == len(short)


def test_allow_oversubscription_records_raised_repeats(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, _ = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--batch-size", "4", "--gpus", "1", "--allow-oversubscription"])
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    doc = _buckets(out)
    assert doc["oversubscribed"] is True and doc["batch_check_ok"] is True
    short = {s["id"]: s["min_repeats"] for s in doc["short_buckets"]}
    assert len(short) == summary["short_buckets"] > 0
    for bucket in doc["buckets"]:
        if bucket["id"] in short:
            assert bucket["repeats"] == short[bucket["id"]] > 1
            assert bucket["count"] * bucket["repeats"] >= 4
        else:
            assert bucket["repeats"] == 1


def test_missing_source_exits_3_with_one_line(tmp_path: Path, run_scan: RunScan):
    missing = tmp_path / "no-such-dir"
    proc = run_scan([missing, "--out", tmp_path / "out"])
    assert proc.returncode == 3
    _no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(missing) in errors[0] and "no such directory" in errors[0]
    assert proc.stdout == ""
    assert not (tmp_path / "out" / "metadata.parquet").exists()

    table = run_scan([tmp_path / "nothing.parquet", "--out", tmp_path / "out"])
    assert table.returncode == 3 and "no such table" in table.stderr
    _no_traceback(table)


def test_bad_option_exits_2(tmp_path: Path, run_scan: RunScan):
    proc = run_scan([tmp_path, "--out", tmp_path / "out", "--threads", "0"])
    assert proc.returncode == 2
    assert "--threads" in proc.stderr
    bad_column = run_scan([tmp_path, "--out", tmp_path / "out", "--column", "pth=x"])
    assert bad_column.returncode == 2


def test_help_mentions_environment_variables(run_scan: RunScan):
    proc = run_scan(["--help"])
    assert proc.returncode == 0
    for name in ("STK_SCAN_OUT", "STK_SCAN_COLUMN", "STK_SCAN_MAX_ERRORS", "STK_SCAN_S3_ENDPOINT_URL"):
        assert re.search(rf"\b{name}\b", proc.stdout), name
    assert "Exit codes" in proc.stdout


def test_environment_variable_sets_an_option(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, _ = dataset
    out = tmp_path / "from-env"
    proc = run_scan([root, "--out", out, "--gpus", "1"], env={"STK_SCAN_BATCH_SIZE": "4"})
    assert proc.returncode == 5, proc.stderr  # the batch size came from the environment
    assert _buckets(out)["batch_size"] == 4
    # the command line wins over the environment
    proc = run_scan([root, "--out", out, "--gpus", "1", "--batch-size", "1"], env={"STK_SCAN_BATCH_SIZE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert _buckets(out)["batch_size"] == 1


def test_family_sets_the_alignment_default_and_refuses_one_it_cannot_train(
    dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path
):
    root, _ = dataset
    common = [root, "--resolution", "64", "--batch-size", "1", "--family", "flux"]
    proc = run_scan([*common, "--out", tmp_path / "family"])
    assert proc.returncode == 0, proc.stderr
    doc = _buckets(tmp_path / "family")
    assert doc["alignment"] == 16 and all(b["width"] % 16 == 0 == b["height"] % 16 for b in doc["buckets"])

    refused = run_scan([*common, "--alignment", "24", "--out", tmp_path / "refused"])
    assert refused.returncode == 3, refused.stderr
    _no_traceback(refused)
    assert "--alignment 24: Flux needs bucket sides that are multiples of 16; use 16 or 32" in refused.stderr
    assert not (tmp_path / "refused").exists()
