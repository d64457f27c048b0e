"""A scan made with a relative path (`stk-scan images --out scan`) and used by stk-cache from another working
directory, through the real CLIs: stk-scan records its root absolutely, so the cache finds every image; a scan made
before that (a relative root) is still read from its own directory, and from anywhere else stk-cache fails past
--max-errors (exit 4, one line naming the root) instead of caching nothing and exiting 0."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.commands import cache_command, cache_env, scan_command, scan_env, summary_of

from stk.datagen import make_image
from stk.models import Family, build_tiny_model

pytestmark = pytest.mark.integration

IMAGES = 12


def run(command: list[str], cwd: Path, cache: bool = True) -> subprocess.CompletedProcess[str]:
    env = cache_env() if cache else scan_env()
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(a directory holding images/ and scan/, scanned from inside it with relative paths; a tiny SD model)."""
    top = tmp_path_factory.mktemp("project")
    (top / "images").mkdir()
    for i in range(IMAGES):
        make_image(64, 64, seed=i).save(top / "images" / f"im{i:02d}.png")
    args = ["images", "--out", "scan", "--resolution", "64", "--alignment", "64", "-q"]
    proc = run(scan_command(args), cwd=top, cache=False)
    assert proc.returncode == 0, proc.stderr
    model = build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("model") / "sd"))
    return top, model


def test_a_relative_scan_is_recorded_absolutely_and_caches_from_elsewhere(
    made: tuple[Path, str], tmp_path: Path
) -> None:
    top, model = made
    summary = json.loads((top / "scan" / "summary.json").read_text())
    assert summary["root"] == str(top / "images")

    proc = run(cache_command([top / "scan", "--model", model, "--out", "cache"], mpi=2), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    built = summary_of(proc)
    assert (built["encoded_images"], built["errors"]) == (IMAGES, 0)
    verify = run(cache_command(["verify", "cache", "--scan", top / "scan"]), cwd=tmp_path)
    assert verify.returncode == 0, verify.stderr


def _old_scan(top: Path) -> Path:
    """A copy of the scan as an older stk-scan wrote it: the root as given on its command line."""
    scan = top / "old-scan"
    if not scan.exists():
        scan.mkdir()
        for name in ("metadata.parquet", "buckets.json", "errors.jsonl"):
            (scan / name).write_bytes((top / "scan" / name).read_bytes())
        summary: dict[str, Any] = json.loads((top / "scan" / "summary.json").read_text())
        (scan / "summary.json").write_text(json.dumps({**summary, "root": "images"}))
    return scan


def test_an_old_relative_scan_from_elsewhere_fails_past_max_errors_and_still_works_from_its_directory(
    made: tuple[Path, str], tmp_path: Path
) -> None:
    top, model = made
    scan = _old_scan(top)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    started = time.monotonic()
    proc = run(cache_command([scan, "--model", model, "--out", "cache"], mpi=2), cwd=elsewhere)
    seconds = time.monotonic() - started
    assert proc.returncode == 4, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    assert f"{IMAGES} of {IMAGES} images could not be cached" in errors[0]
    assert "--max-errors 1%" in errors[0] and f"unreadable: {IMAGES}" in errors[0], errors[0]
    assert "cache/errors.jsonl" in errors[0] and "read from images" in errors[0], errors[0]
    assert "relative root 'images'" in proc.stderr  # the warning that says to rescan
    assert seconds < 120, f"{seconds:.0f} s"
    rows = [json.loads(line) for line in (elsewhere / "cache" / "errors.jsonl").read_text().splitlines()]
    assert len(rows) == IMAGES and {row["kind"] for row in rows} == {"unreadable"}

    tolerated = run(cache_command([scan, "--model", model, "--out", "cache2", "--max-errors", "100%"]), cwd=elsewhere)
    assert tolerated.returncode == 0, tolerated.stderr  # the user can choose to accept it
    assert summary_of(tolerated)["errors"] == IMAGES

    at_home = run(cache_command([scan, "--model", model, "--out", "cache"]), cwd=top)
    assert at_home.returncode == 0, at_home.stderr
    assert summary_of(at_home)["encoded_images"] == IMAGES
    verify = run(cache_command(["verify", "cache", "--scan", scan]), cwd=top)
    assert verify.returncode == 0, verify.stderr


def test_a_bad_max_errors_is_refused_before_any_model_loads(made: tuple[Path, str], tmp_path: Path) -> None:
    top, model = made
    started = time.monotonic()
    proc = run(cache_command([top / "scan", "--model", model, "--out", "cache", "--max-errors", "lots"]), tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "--max-errors 'lots'" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60 and not (tmp_path / "cache").exists()
