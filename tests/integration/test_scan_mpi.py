"""stk-scan under real MPI ranks (mpiexec from the venv's MPICH): the same outputs as one rank,
and a scan killed with SIGKILL resumes from its journal without losing or duplicating rows."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from support.commands import RunScan, one_error, scan_command, scan_env, summary_of
from support.processes import mpi_rank_pids, process_ended

from stk.cluster.lease import Holder, lease_name
from stk.datagen import generate_dataset, make_image
from stk.errors import ExitCode

pytestmark = pytest.mark.integration

JOURNAL = ".scan-journal"
SCAN_LEASE = lease_name("stk-scan")


def _table(out: Path) -> pa.Table:
    return pq.read_table(out / "metadata.parquet")


def _journal_chunks(out: Path) -> list[str]:
    try:
        return [n for n in os.listdir(out / JOURNAL) if n.endswith(".parquet")]
    except FileNotFoundError:
        return []


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL whatever is left of the process group the scan was started in."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=30)


# --- the same outputs on 1 and 2 ranks ------------------------------------------------


def test_two_ranks_give_the_same_outputs_as_one(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    generate_dataset(str(root), count=56, seed=3)
    (root / "bad").mkdir()
    (root / "bad" / "empty.jpg").write_bytes(b"")
    (root / "bad" / "text.png").write_text("not an image\n" * 20)
    buffer = io.BytesIO()
    make_image(256, 256, seed=1).save(buffer, "JPEG", quality=90)
    (root / "bad" / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    make_image(32, 32).save(root / "bad" / "icon.png", "ICO")

    args = ["--gpus", "1", "--max-errors", "100", "--threads", "2", "--commit-every", "7"]
    one = run_scan([root, "--out", tmp_path / "one", *args])
    assert one.returncode == 0, one.stderr
    two = run_scan([root, "--out", tmp_path / "two", *args], mpi=2)
    assert two.returncode == 0, two.stderr
    assert "Traceback" not in two.stderr

    s1, s2 = summary_of(one), summary_of(two)
    assert (s1["ranks"], s2["ranks"]) == (1, 2)
    assert s2["files"] == 60 and s2["errors"] == 4
    assert {"empty", "not_image", "truncated", "unsupported_format"} <= set(s2["error_kinds"])
    for key in ("files", "images", "errors", "skipped", "error_kinds", "scanned", "buckets"):
        assert s1[key] == s2[key], key

    t1, t2 = _table(tmp_path / "one"), _table(tmp_path / "two")
    assert t1.num_rows == s1["images"] > 40
    assert t2.equals(t1)
    for name in ("errors.jsonl", "buckets.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert len((tmp_path / "two" / "errors.jsonl").read_text().splitlines()) == s2["errors"] + s2["skipped"]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["ranks"] == 2
    assert not (tmp_path / "two" / JOURNAL).exists()
    assert not (tmp_path / "two" / SCAN_LEASE).exists()  # rank 0's, released


def test_a_held_out_stops_both_ranks_with_one_line(tmp_path: Path, run_scan: RunScan):
    """Rank 0 alone takes --out's lease; its refusal reaches the other rank, which neither hangs nor logs it again."""
    generate_dataset(str(tmp_path / "data"), count=4, seed=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / SCAN_LEASE).write_text(json.dumps(asdict(Holder("node7", 4242, "run-7", "1234", 0))))
    proc = run_scan([tmp_path / "data", "--out", out], mpi=2)
    one_error(proc, ExitCode.PREFLIGHT, "in use by another stk-scan run (host node7, pid 4242, Slurm job 1234")
    assert os.listdir(out) == [SCAN_LEASE]


def test_datasets_on_two_ranks_give_the_same_outputs_as_one(tmp_path: Path, run_scan: RunScan):
    for name, count in (("a", 20), ("b", 9)):
        generate_dataset(str(tmp_path / name), count=count, seed=count)
    listed = tmp_path / "datasets.toml"
    listed.write_text(
        f'[[dataset]]\nname = "a"\nsource = "{tmp_path / "a"}"\nresolution = 96\n\n'
        f'[[dataset]]\nname = "b"\nsource = "{tmp_path / "b"}"\nrepeats = 3\n'
    )
    args = [
        "--datasets",
        listed,
        "--gpus",
        "1",
        "--alignment",
        "16",
        "--missing-caption",
        "empty",
        "--threads",
        "2",
        "--allow-oversubscription",
    ]
    one = run_scan([*args, "--out", tmp_path / "one"])
    assert one.returncode == 0, one.stderr
    two = run_scan([*args, "--out", tmp_path / "two"], mpi=2)
    assert two.returncode == 0, two.stderr
    assert [d["images"] for d in summary_of(two)["datasets"]] == [20, 9]
    assert _table(tmp_path / "two").equals(_table(tmp_path / "one"))
    assert _table(tmp_path / "two").column("dataset").to_pylist() == ["a"] * 20 + ["b"] * 9
    for name in ("errors.jsonl", "buckets.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


# --- SIGKILL and resume ---------------------------------------------------------------


@pytest.fixture(scope="module")
def many_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 tiny PNGs in 10 folders (64 distinct sizes), a caption sidecar for every third."""
    root = tmp_path_factory.mktemp("many")
    rng = random.Random(0)
    blobs = []
    for k in range(64):
        buffer = io.BytesIO()
        Image.new("RGB", (12 + k % 8 * 2, 12 + k // 8 * 2), (k * 4, 0, 0)).save(buffer, "PNG")
        blobs.append(buffer.getvalue())
    for i in range(10_000):
        folder = root / f"d{i // 1000:02d}"
        folder.mkdir(exist_ok=True)
        (folder / f"im{i:05d}.png").write_bytes(blobs[rng.randrange(len(blobs))])
        if i % 3 == 0:
            (folder / f"im{i:05d}.txt").write_text(f"caption {i}")
    return root


ARGS = ["--commit-every", "50", "--threads", "1", "--gpus", "1", "-q"]


@pytest.fixture(scope="module")
def clean_scan(many_images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scan of `many_images` that was never interrupted (2 ranks, for speed)."""
    out = tmp_path_factory.mktemp("clean") / "out"
    proc = subprocess.run(
        scan_command([many_images, "--out", out, *ARGS], mpi=2),
        capture_output=True,
        text=True,
        env=scan_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["files"] == 10_000
    return out


def _start_and_kill(source: Path, out: Path, mpi: int, victim_rank: int = 0, min_chunks: int = 3) -> str:
    """Start a scan, SIGKILL one of its processes once `min_chunks` journal chunks exist, wait
    for the rest to end; returns the scan's stderr."""
    proc = subprocess.Popen(
        scan_command([source, "--out", out, *ARGS], mpi=mpi),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=scan_env(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_journal_chunks(out)) < min_chunks:
            assert proc.poll() is None, f"the scan ended before it could be killed: {proc.communicate()}"
            assert time.monotonic() < deadline, "no journal chunks after 60 s"
            time.sleep(0.002)
        if mpi:
            ranks = mpi_rank_pids(proc.pid, "stk.cli.scan")
            assert sorted(ranks) == list(range(mpi)), ranks
            os.kill(ranks[victim_rank], signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        if mpi:  # mpiexec ends the other ranks: none may live on and keep writing to OUT
            assert all(process_ended(pid, 10) for pid in ranks.values()), ranks
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    assert not (out / "metadata.parquet").exists(), "the scan finished before the kill: make the dataset larger"
    return stderr


def _resume_and_compare(source: Path, out: Path, clean: Path, mpi: int, run_scan: RunScan) -> dict[str, Any]:
    chunks = _journal_chunks(out)
    assert len(chunks) >= 3, chunks
    journaled = sum(pq.read_metadata(out / JOURNAL / name).num_rows for name in chunks)
    assert journaled >= 150

    proc = run_scan([source, "--out", out, *ARGS], mpi=mpi)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["files"] == 10_000
    assert summary["reused"] >= journaled > 0  # every committed record was kept
    assert summary["scanned"] == 10_000 - summary["reused"] > 0
    assert not (out / JOURNAL).exists()

    resumed, reference = _table(out), _table(clean)
    paths = resumed.column("path").to_pylist()
    assert len(paths) == len(set(paths)) == reference.num_rows  # no duplicates, nothing lost
    assert resumed.equals(reference)
    for name in ("errors.jsonl", "buckets.json"):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    return summary


@pytest.mark.parametrize("victim_rank", [1, 0])
def test_kill9_one_rank_then_resume_on_one_rank(
    many_images: Path, clean_scan: Path, tmp_path: Path, run_scan: RunScan, victim_rank: int
):
    out = tmp_path / "out"
    _start_and_kill(many_images, out, mpi=2, victim_rank=victim_rank)
    # chunks from both ranks of the killed run are reused by a run with another rank count
    summary = _resume_and_compare(many_images, out, clean_scan, mpi=0, run_scan=run_scan)
    assert summary["reused"] > 0 and summary["ranks"] == 1


def test_kill9_single_process_then_resume_on_two_ranks(
    many_images: Path, clean_scan: Path, tmp_path: Path, run_scan: RunScan
):
    out = tmp_path / "out"
    _start_and_kill(many_images, out, mpi=0)
    summary = _resume_and_compare(many_images, out, clean_scan, mpi=2, run_scan=run_scan)
    assert summary["reused"] > 0 and summary["ranks"] == 2


def test_kill9_twice_then_resume(many_images: Path, clean_scan: Path, tmp_path: Path, run_scan: RunScan):
    """A resumed run killed again keeps the chunks of both killed runs."""
    out = tmp_path / "out"
    _start_and_kill(many_images, out, mpi=2, victim_rank=1)
    first = len(_journal_chunks(out))
    _start_and_kill(many_images, out, mpi=0, min_chunks=first + 3)
    assert len(_journal_chunks(out)) >= first + 3
    summary = _resume_and_compare(many_images, out, clean_scan, mpi=2, run_scan=run_scan)
    assert summary["reused"] >= 300
