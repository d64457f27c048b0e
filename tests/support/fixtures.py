"""Shared fixtures: a generated dataset, a way to run stk-scan as users do, a real S3 server
(SeaweedFS `weed mini`) for the session, a real one-node Slurm, an apprise receiver, and the
scan, tiny models and caches that stk-train's tests share. tests/conftest.py brings them to every
test directory; helpers that are not fixtures live in the other modules of tests/support/."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from stk.cluster.slurm import free_port
from stk.datagen import (
    FormatSample,
    GeneratedImage,
    generate_dataset,
    generate_format_samples,
)
from stk.models import Family, build_tiny_model
from stk.train.deepspeed.distributed import DistEnv, init_distributed
from support.alert_receiver import Receiver
from support.commands import (
    EXTENSIONS_DIR,
    FRESH_EXTENSIONS_DIR,
    LOUD,
    TRAIN,
    TRAIN_IMAGES,
    Mount,
    RunScan,
    cache_command,
    run_train,
    scan_command,
    scan_env,
)
from support.slurm_cluster import SlurmCluster
from support.train_outputs import PROMPTS
from support.weed_server import WeedServer

SHARED_MEMORY = Path("/dev/shm")


@pytest.fixture(autouse=True)
def _no_shared_memory_left_behind() -> Iterator[None]:
    """DeepSpeed's CPU all-reduce maps a 66 MiB file in /dev/shm per rank and master port, and a rank
    that a test kills never removes it: in RAM, across a whole session. Those of a test go when it ends
    (its ranks have ended too)."""
    before = set(SHARED_MEMORY.glob("deepspeed_allreduce_buffer_*"))
    yield
    for leftover in set(SHARED_MEMORY.glob("deepspeed_allreduce_buffer_*")) - before:
        leftover.unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def _fresh_op_builds() -> Iterator[None]:
    """The session's build directory for DeepSpeed's ops (commands.EXTENSIONS_DIR) goes when the session ends."""
    yield
    if FRESH_EXTENSIONS_DIR:
        shutil.rmtree(EXTENSIONS_DIR, ignore_errors=True)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A torch.distributed world of this process alone, started as stk-train starts it; the environment it exports
    (RANK, MASTER_ADDR, ...) put back after, and the clone of the world's group DeepSpeed keeps (made once per
    process, for the first world) its own, so that a later test's world gets a clone of itself."""
    world_group = mock.patch("deepspeed.utils.groups._WORLD_GROUP", None)
    with mock.patch.dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR)), world_group:
        init_distributed(DistEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "here"), backend="gloo")
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """A command run in-process (CliRunner) points the 'stk' logger at the runner's stderr; put it back afterwards."""
    logger = logging.getLogger("stk")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def run_scan() -> RunScan:
    """run_scan(args, stdin=None, mpi=0, env=None, timeout=120) -> CompletedProcess (text)."""

    def run(
        args: list[Any],
        stdin: str | None = None,
        mpi: int = 0,
        env: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        full_env = scan_env()
        full_env.update(env or {})
        return subprocess.run(
            scan_command(args, mpi),
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
        )

    return run


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[GeneratedImage]]:
    """48 generated images (every format, some EXIF-rotated, most with a caption sidecar)."""
    root = tmp_path / "dataset"
    made = generate_dataset(str(root), count=48, seed=1)
    return root, made


# --- a real S3 server -------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SeaweedFS server (`weed mini`) on 127.0.0.1, on free ports; yields the S3 endpoint URL."""
    server = WeedServer(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server.endpoint
    finally:
        server.stop()


# --- a small tmpfs: a disk that fills, a file system remounted read-only ---------------------


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    """mount(name, options) -> a tmpfs at tmp_path/name mounted with `options`; all unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a disk that fills, a remount read-only) needs root")
    mounted: list[Path] = []

    def do(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield do
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- a local HTTP receiver for apprise json:// alerts -----------------------------------


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def start(port: int = 0) -> Receiver:
        started.append(Receiver(port))
        return started[-1]

    yield start
    for r in started:
        r.close()


# --- a scanned dataset, tiny models and caches for stk-train (the training tests) ------------------------------


@pytest.fixture(scope="session")  # read-only for every test: one scan for the session
def scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("train-data")
    generate_dataset(str(data), count=TRAIN_IMAGES, seed=7, min_side=64, max_side=80)
    out = tmp_path_factory.mktemp("train-scan") / "scan"
    command = [
        str(Path(TRAIN[0])),
        "-m",
        "stk.cli.scan",
        data,
        "--out",
        out,
        "--resolution",
        "64",
        "--alignment",
        "64",
        "--batch-size",
        "1",
        "--gpus",
        "2",
        "-q",
    ]
    proc = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=scan_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


PROMPTS_CACHED = frozenset(Family) - {Family.SD, Family.SDXL}


@pytest.fixture(scope="session")  # tests copy a model or cache before changing it
def setups(scan: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Family], tuple[str, Path]]:
    """setups(family) -> (model dir, cache dir), built on first use. The caches of PROMPTS_CACHED hold PROMPTS'
    embeddings: a run on them loads no text encoder; one on SD's or SDXL's encodes the prompts itself."""
    done: dict[Family, tuple[str, Path]] = {}

    def get(family: Family) -> tuple[str, Path]:
        if family not in done:
            root = tmp_path_factory.mktemp(f"train-{family.value}")
            model = build_tiny_model(family, str(root / "model"))
            cache = root / "cache"
            args = [scan, "--model", model, "--out", cache, "--dtype", "float32", "-q"]
            if family in PROMPTS_CACHED:  # the cache holds the sample prompts (what stk-cache --validation-prompts
                prompts = root / "prompts.txt"  # does); a run on it samples them unless told otherwise
                prompts.write_text("\n".join(PROMPTS) + "\n")
                args += ["--validation-prompts", prompts]
            env = {**scan_env(), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cache_command(args), capture_output=True, text=True, env=env, timeout=300)
            assert proc.returncode == 0, proc.stderr
            done[family] = (model, cache)
        return done[family]

    return get


# --- the one-node Slurm, as stk.health.slurm's drain and resume see it ------------------------------------------


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """The session cluster with SLURM_CONF in this process's environment; the node idle again after."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm_cluster.env.get("PATH", os.defpath))
    yield slurm_cluster
    slurm_cluster.run(["scontrol", "update", f"NodeName={slurm_cluster.node}", "State=RESUME"], check=False)
    slurm_cluster.wait_idle()


# --- image formats, shards, checkpoints and weights that a unit test module and its integration half share -----


@pytest.fixture(scope="session")  # read-only for every test
def format_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[FormatSample]]:
    """(its root, the samples): one file of every format and orientation transform stk reads (stk.datagen)."""
    root = tmp_path_factory.mktemp("formats") / "samples"
    return root, generate_format_samples(str(root))


@pytest.fixture
def cache(tmp_path: Path) -> str:
    """Where a test's shard cache goes (not made yet)."""
    return str(tmp_path / "cache")


@pytest.fixture(scope="session")  # tests that change it take `copied`
def trained(
    setups: Callable[[Family], tuple[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[Any], Path]:
    """(the run's arguments less --output-dir and --max-steps, its output): 4 steps on 2 ranks, checkpoints at 2
    and 4 (both kept), an EMA sharded over the ranks."""
    model, cache = setups(Family.SD)
    args = [
        "--cache",
        cache,
        "--model",
        model,
        "--checkpoint-every",
        "2",
        "--keep-checkpoints",
        "2",
        "--ema-decay",
        "0.8",
        "--no-validation",
        *LOUD,
    ]
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run_train([*args, "--output-dir", out, "--max-steps", "4"])
    assert proc.returncode == 0, proc.stderr
    return args, out


@pytest.fixture
def copied(trained: tuple[list[Any], Path], tmp_path: Path) -> tuple[list[Any], Path]:
    """`trained`, copied for a test to change."""
    args, out = trained
    copy = tmp_path / "run"
    shutil.copytree(out, copy, symlinks=True)
    return args, copy


@pytest.fixture(scope="session")  # read-only for every test
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDXL pipeline."""
    return Path(build_tiny_model(Family.SDXL, str(tmp_path_factory.mktemp("weights") / "sdxl")))
