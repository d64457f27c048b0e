"""S3 outages met by each command: stk-scan, stk-cache and stk-train ride through a stopped server (the harder case:
requests hang until their timeouts) and end with exit 69 (one line) on a killed one past --s3-retry-seconds, and a
rerun finishes.
Every test has its own SeaweedFS server, stopped (SIGSTOP) or killed and started again on the same ports and data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.commands import cache_command, cache_env, scan_command, scan_env, summary_of, train_command, train_env
from support.s3_outages import _outage, _recover
from support.weed_server import WeedServer, s3_client

from stk.cluster.lease import lease_name
from stk.datagen import generate_dataset
from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration


OUTAGE_S = 10  # a server restart, or a failover
BUDGET_S = 5  # the short --s3-retry-seconds of the tests that outlast it
STOP_BUDGET_S = 30  # timeouts of 2.5 s: a stopped server is noticed (two attempts) within the 10 s outage
EXIT_BOUND_S = BUDGET_S + 40  # past the budget: one attempt's timeouts, the ranks' teardown, a loaded machine


@dataclass
class Outcome:
    proc: subprocess.CompletedProcess[str]
    exit_s: float  # from the start of the fault to the command's exit

    def lines(self, text: str) -> list[str]:
        return [line for line in self.proc.stderr.splitlines() if text in line]

    def assert_waited_once_per_rank(self) -> None:
        """Each rank that met the outage logged it once, and its end once (not per thread, per attempt)."""
        waits = self.lines("is not answering")
        assert waits, self.proc.stderr
        for rank in ("r0@", "r1@"):
            mine = [line for line in waits if f" {rank}" in line]
            back = [line for line in self.lines("answers again") if f" {rank}" in line]
            assert len(mine) <= 1 and len(back) == len(mine), self.proc.stderr

    def assert_gave_up(self, weed: WeedServer) -> None:
        """Exit 69, one error line naming the endpoint and the budget (from each rank whose budget ran
        out before the abort reached it, at most one per rank), no traceback, in bounded time."""
        assert self.proc.returncode == ExitCode.INFRA, self.proc.stderr
        assert "Traceback" not in self.proc.stderr, self.proc.stderr
        errors = self.lines(" ERROR ")
        reporters = [line.split(" ERROR ")[0].split()[-1] for line in errors]  # "r1@vm"
        assert errors and len(set(reporters)) == len(reporters), self.proc.stderr
        for line in errors:
            assert weed.endpoint in line and f"did not answer for {BUDGET_S} s" in line, errors
        assert self.exit_s < EXIT_BOUND_S, self.exit_s


def _run_with_fault(
    command: list[str],
    env: dict[str, str],
    weed: WeedServer,
    fault: str,
    started: Callable[[], bool],
    outage_s: float | None,
) -> Outcome:
    """Run `command`; once `started()` holds, stop or kill the server, and bring it back after `outage_s`
    (None: only after the command has ended, which must then come within EXIT_BOUND_S)."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    with ThreadPoolExecutor(2) as pool:  # read both pipes as they fill
        out, err = pool.submit(proc.stdout.read), pool.submit(proc.stderr.read)  # type: ignore[union-attr]
        deadline = time.monotonic() + 240
        while not started() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, f"ended before the fault:\n{err.result()}"
        fault_at = time.monotonic()
        _outage(weed, fault)
        try:
            if outage_s is not None:
                time.sleep(outage_s)
                _recover(weed, fault)
            code = proc.wait(timeout=300 if outage_s is not None else EXIT_BOUND_S)
            exit_s = time.monotonic() - fault_at
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and its ranks
            proc.wait()
            pytest.fail(f"still running {time.monotonic() - fault_at:.0f} s after the fault:\n{err.result()[-3000:]}")
        finally:
            if outage_s is None:
                _recover(weed, fault)
    completed = subprocess.CompletedProcess(command, code, out.result(), err.result())
    print(f"{' '.join(command[-6:])}: {fault}, outage {outage_s} s -> exit {code} after {exit_s:.1f} s")
    return Outcome(completed, exit_s)


def _files(pattern: str, root: Path) -> Callable[[], bool]:
    return lambda: any(root.glob(pattern))


def _upload(weed: WeedServer, bucket: str, root: Path, prefix: str) -> str:
    client = s3_client(weed.endpoint)
    client.create_bucket(Bucket=bucket)
    paths = [p for p in sorted(root.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(root)}"), paths))
    return f"s3://{bucket}/{prefix}"


# --- stk-scan: listing, sidecar captions and ranged header reads, on 2 ranks x 2 threads


SCAN_IMAGES = 400


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    generate_dataset(str(root), count=SCAN_IMAGES, seed=3, min_side=64, max_side=80)
    return root


def _scan_args(url: str, out: Path, weed: WeedServer, budget: float) -> list[str]:
    return [
        url,
        "--out",
        str(out),
        "--s3-endpoint-url",
        weed.endpoint,
        "--s3-retry-seconds",
        f"{budget:g}",
        "--threads",
        "2",
        "--commit-every",
        "10",
        "--resolution",
        "64",
        "--batch-size",
        "1",
        "--gpus",
        "1",
    ]


def test_scan_rides_through_an_outage(weed: WeedServer, images: Path, tmp_path: Path):
    url = _upload(weed, "scan", images, "set")
    out = tmp_path / "out"
    command = scan_command(_scan_args(url, out, weed, STOP_BUDGET_S), mpi=2)
    outcome = _run_with_fault(command, scan_env(), weed, "stop", _files(".scan-journal/*", out), OUTAGE_S)
    assert outcome.proc.returncode == 0, outcome.proc.stderr
    outcome.assert_waited_once_per_rank()
    summary = summary_of(outcome.proc)
    assert summary["images"] == SCAN_IMAGES and summary["errors"] == 0, summary  # no image taken for unreadable


def test_scan_past_the_budget_exits_69_and_a_rerun_finishes(weed: WeedServer, images: Path, tmp_path: Path):
    url = _upload(weed, "scan", images, "set")
    out = tmp_path / "out"
    command = scan_command(_scan_args(url, out, weed, BUDGET_S), mpi=2)
    outcome = _run_with_fault(command, scan_env(), weed, "kill", _files(".scan-journal/*", out), None)
    outcome.assert_gave_up(weed)
    rerun = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = summary_of(rerun)
    assert summary["images"] == SCAN_IMAGES and summary["errors"] == 0 and summary["reused"] > 0, summary


# --- stk-cache: images read from S3 on 2 ranks x 2 threads, shards, parts and manifest written to S3


@pytest.fixture(scope="module")
def sd_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from stk.models import build_tiny_model

    return build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("model") / "sd"))


def _scan_on(weed: WeedServer, images: Path, out: Path) -> None:
    url = _upload(weed, "images", images, "set")
    args = [url, "--out", out, "--s3-endpoint-url", weed.endpoint, "--resolution", "64", "--batch-size", "1", "-q"]
    command = scan_command(list(map(str, args)))
    proc = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr


def _verify(weed: WeedServer, cache: str, scan: Path) -> None:
    args = ["verify", cache, "--scan", scan, "--s3-endpoint-url", weed.endpoint]
    proc = subprocess.run(cache_command(args), capture_output=True, text=True, env=cache_env(), timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stdout + proc.stderr


def _cache_run(
    weed: WeedServer, images: Path, sd_model: str, tmp_path: Path, budget: float
) -> tuple[list[str], dict[str, str], Path]:
    """(the 2-rank stk-cache command, its environment, its scan) for a cache written to S3."""
    scan = tmp_path / "scan"
    _scan_on(weed, images, scan)
    s3_client(weed.endpoint).create_bucket(Bucket="cache")
    args = [
        scan,
        "--model",
        sd_model,
        "--out",
        "s3://cache/c",
        "--s3-endpoint-url",
        weed.endpoint,
        "--s3-retry-seconds",
        f"{budget:g}",
        "--threads",
        "2",
        "--batch-size",
        "4",
    ]
    env = {**cache_env(), "STK_CACHE_WORK_DIR": str(tmp_path / "work")}
    return cache_command(args, mpi=2), env, scan


def test_cache_rides_through_an_outage(weed: WeedServer, images: Path, sd_model: str, tmp_path: Path):
    command, env, scan = _cache_run(weed, images, sd_model, tmp_path, STOP_BUDGET_S)
    started = _files("*/*.h5.tmp", tmp_path / "work")
    outcome = _run_with_fault(command, env, weed, "stop", started, OUTAGE_S)
    assert outcome.proc.returncode == 0, outcome.proc.stderr
    outcome.assert_waited_once_per_rank()
    summary = summary_of(outcome.proc)
    assert summary["encoded_images"] == SCAN_IMAGES and summary["errors"] == 0, summary
    _verify(weed, "s3://cache/c", scan)


def test_cache_past_the_budget_exits_69_and_a_rerun_finishes(
    weed: WeedServer, images: Path, sd_model: str, tmp_path: Path
):
    command, env, scan = _cache_run(weed, images, sd_model, tmp_path, BUDGET_S)
    outcome = _run_with_fault(command, env, weed, "kill", _files("*/*.h5.tmp", tmp_path / "work"), None)
    outcome.assert_gave_up(weed)
    rerun = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = summary_of(rerun)
    assert summary["images"] == SCAN_IMAGES and summary["errors"] == 0, summary
    _verify(weed, "s3://cache/c", scan)


# --- stk-train: whole shards fetched from S3 on 2 ranks, with a local limit below one shard. Which
# step next needs a fetch depends on the shuffle, so the ride-through starts its outage as soon as
# the run holds its lease, before its first read from S3 (the plan, then every rank's first
# shards); giving up is tested mid-run, where some later step must fetch from the dead server.


@pytest.fixture(scope="module")
def two_shards(scan: Path, sd_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local cache of the `scan` fixture's in two shards (one per writer rank)."""
    cache = tmp_path_factory.mktemp("train-cache") / "cache"
    args = [scan, "--model", sd_model, "--out", cache, "--dtype", "float32", "-q"]
    proc = subprocess.run(cache_command(args, mpi=2), capture_output=True, text=True, env=cache_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(list((cache / "shards").iterdir())) == 2
    return cache


TRAIN_STEPS = 30


def _train_command(weed: WeedServer, scan: Path, model: str, out: Path, budget: float) -> list[str]:
    args = [
        "--cache",
        "s3://train/cache",
        "--scan",
        scan,
        "--model",
        model,
        "--output-dir",
        out,
        "--epochs",
        "3",
        "--max-steps",
        TRAIN_STEPS,
        "--checkpoint-every",
        "4",
        "--local-cache-size",
        "1e-6",
        "--loader-threads",
        "2",
        "--prefetch",
        "1",
        "--batch-size",
        "1",
        "--lr",
        "1e-3",
        "--precision",
        "fp32",
        "-q",
        "--s3-endpoint-url",
        weed.endpoint,
        "--s3-retry-seconds",
        f"{budget:g}",
    ]
    return train_command(list(map(str, args)), mpi=2)


def _trained_steps(out: Path) -> Callable[[], int]:
    def steps() -> int:
        path = out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    return steps


def _assert_each_step_once(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, TRAIN_STEPS + 1)), rows


def test_train_rides_through_an_outage(weed: WeedServer, scan: Path, sd_model: str, two_shards: Path, tmp_path: Path):
    _upload(weed, "train", two_shards, "cache")
    out = tmp_path / "run"
    outcome = _run_with_fault(
        _train_command(weed, scan, sd_model, out, STOP_BUDGET_S),
        train_env(),
        weed,
        "stop",
        lambda: (out / lease_name("stk-train")).exists(),
        OUTAGE_S,
    )
    assert outcome.proc.returncode == 0, outcome.proc.stderr
    assert "Traceback" not in outcome.proc.stderr, outcome.proc.stderr
    outcome.assert_waited_once_per_rank()
    _assert_each_step_once(out)


def test_train_past_the_budget_exits_69_and_a_rerun_finishes(
    weed: WeedServer, scan: Path, sd_model: str, two_shards: Path, tmp_path: Path
):
    _upload(weed, "train", two_shards, "cache")
    out = tmp_path / "run"
    command = _train_command(weed, scan, sd_model, out, BUDGET_S)
    steps = _trained_steps(out)
    outcome = _run_with_fault(command, train_env(), weed, "kill", lambda: steps() >= 2, None)
    outcome.assert_gave_up(weed)
    assert steps() < TRAIN_STEPS
    rerun = subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    _assert_each_step_once(out)
