"""Every format a trainer can decode, through the real CLIs: stk-scan on one rank and two, stk-cache encoding every
format, a bad --formats list. The corpus is made by the tests (stk.datagen); header reads:
tests/unit/images/test_formats.py."""

from __future__ import annotations

import json
import subprocess

import pyarrow.parquet as pq
import pytest
from support.commands import cache_command, cache_env, scan_command, scan_env

from stk.errors import ExitCode
from stk.models import Family, build_tiny_model

# --- through the commands ----------------------------------------------------------------------------

# 19 landscape and 9 portrait images: a batch of 5 fits on 1 GPU, not on 2 (ranks are not GPUs);
# the ICO and the SVG are the 2 errors allowed
SCAN_ARGS = ["--resolution", "64", "--alignment", "16", "--batch-size", "5", "--max-errors", "2"]


@pytest.mark.integration
def test_one_rank_and_two_give_the_same_tables_and_exit_without_gpus(format_corpus, tmp_path):
    root, samples = format_corpus
    results = {}
    for ranks in (0, 2):
        out = tmp_path / f"scan{ranks}"
        proc = subprocess.run(
            scan_command([root, "--out", out, *SCAN_ARGS], mpi=ranks),
            capture_output=True,
            text=True,
            env=scan_env(),
            timeout=300,
        )
        results[ranks] = (proc, out)
    (one, one_out), (two, two_out) = results[0], results[2]
    errors = sum(s.verdict == "error" for s in samples)
    assert one.returncode == two.returncode == ExitCode.OK, one.stderr + two.stderr
    assert "Traceback" not in one.stderr + two.stderr
    for out in (one_out, two_out):
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["gpus"], summary["gpus_from"], summary["effective_batch_size"]) == (1, "default", 5)
        assert (summary["errors"], summary["warnings"]) == (errors, 2), summary
        assert summary["warning_kinds"] == {"exif_unreadable": 2}
    assert (
        pq.read_table(one_out / "metadata.parquet")
        .drop(["mtime"])
        .equals(pq.read_table(two_out / "metadata.parquet").drop(["mtime"]))
    )
    assert (one_out / "errors.jsonl").read_text() == (two_out / "errors.jsonl").read_text()
    rows = [json.loads(line) for line in (one_out / "errors.jsonl").read_text().splitlines()]
    assert {(r["path"], r["kind"], r["severity"]) for r in rows} == {
        (s.path, s.kind, s.verdict) for s in samples if s.verdict != "image"
    }
    table = pq.read_table(one_out / "metadata.parquet").to_pylist()
    expected = {s.path: (s.width, s.height, s.format) for s in samples if s.verdict != "error"}
    assert {r["path"]: (r["width"], r["height"], r["format"]) for r in table} == expected


@pytest.mark.integration
def test_stk_cache_encodes_every_format(format_corpus, tmp_path):
    root, samples = format_corpus
    scan = tmp_path / "scan"
    args = [root, "--out", scan, *SCAN_ARGS, "--formats", "avif,heic,jxl,jp2,tga,pnm,jpeg", "-q"]
    proc = subprocess.run(scan_command(args), capture_output=True, text=True, env=scan_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    model = build_tiny_model(Family.SD, str(tmp_path / "model"))
    cache = tmp_path / "cache"
    proc = subprocess.run(
        cache_command([scan, "--model", model, "--out", cache, "-q"]),
        capture_output=True,
        text=True,
        env=cache_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["encoded_images"] == sum(s.verdict != "error" for s in samples), summary
    assert summary["errors"] == 0
    assert proc.stderr.strip() == ""  # -q: no third-party noise either


@pytest.mark.integration
def test_a_bad_formats_list_is_a_usage_error(tmp_path):
    proc = subprocess.run(
        scan_command([tmp_path, "--out", tmp_path / "out", "--formats", "jpeg,psd"]),
        capture_output=True,
        text=True,
        env=scan_env(),
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--formats" in proc.stderr and "psd" in proc.stderr and "Traceback" not in proc.stderr
