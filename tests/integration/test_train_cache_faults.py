"""stk-train against a cache that is not what it should be, as users meet it: ranks of a node sharing
one --local-cache-dir under a limit that forces evictions, one flipped byte in a shard made by
stk-cache (local and S3), and a cache made with another model's VAE and text encoders. Real CLIs,
`mpiexec -n 2`, the real S3 server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import h5py
import pytest
from support.commands import FAST, LOUD, cache_command, cache_env, run_train
from support.train_outputs import metrics
from support.weed_server import S3_ENV, s3_client, upload_cache

from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration


def stk_cache(args: list[Any], mpi: int = 0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cache_command(args, mpi), capture_output=True, text=True, env={**cache_env(), **(env or {})}, timeout=300
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


# --- ranks sharing one --local-cache-dir ---------------------------------------------------------------------------


def test_two_ranks_share_one_local_shard_dir_under_a_limit_that_forces_evictions(
    setups, scan, tmp_path, s3_server
) -> None:
    model, _ = setups(Family.SD)
    cache = tmp_path / "cache"  # two shards: one per writer rank
    proc = stk_cache([scan, "--model", model, "--out", cache, "--dtype", "float32", "-q"], mpi=2)
    assert proc.returncode == 0, proc.stderr
    assert len(list((cache / "shards").iterdir())) == 2
    url = upload_cache(s3_client(s3_server), cache)
    local, out = tmp_path / "shards", tmp_path / "run"
    local.mkdir()
    stale = local / "0123456789abcdef-an-earlier-run.h5"  # a copy no process holds: the first to evict
    stale.write_bytes(b"\0" * 4096)
    started = time.monotonic()
    proc = run_train(
        [
            "--cache",
            url,
            "--scan",
            scan,
            "--model",
            model,
            "--output-dir",
            out,
            "--max-steps",
            "8",
            "--local-cache-dir",
            local,
            "--local-cache-size",
            "0.000001",
            "--loader-threads",
            "3",
            "--s3-endpoint-url",
            s3_server,
            *LOUD,
        ],
        env=S3_ENV,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 300
    assert not error_lines(proc.stderr), proc.stderr
    assert [line for line in proc.stderr.splitlines() if f"local shard copies in {local}" in line], proc.stderr
    assert not stale.exists(), "the size limit evicted nothing"  # which rank evicts, and what else, is a race
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    assert not [p for p in local.iterdir() if p.name.startswith(".")], "temp files left"


# --- one flipped byte ----------------------------------------------------------------------------------------------


def flip_byte(shard: Path, where: str) -> None:
    """Flip one byte in the middle of the first latent's zstd chunk, or of the first caption's
    embedding frame, of a shard stk-cache wrote."""
    with h5py.File(shard, "r") as f:
        if where == "latent":
            group = next(iter(f["latents"].values()))
            info = group["mean"].id.get_chunk_info(0)
            offset = info.byte_offset + info.size // 2
        else:
            data = f["text/prompt_embeds/data"]
            start = data.id.get_chunk_info(0).byte_offset if data.chunks else data.id.get_offset()
            offset = start + int(f["text/prompt_embeds/end"][0]) // 2
    with open(shard, "r+b") as raw:
        raw.seek(offset)
        byte = raw.read(1)
        raw.seek(offset)
        raw.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize(("storage", "where"), [("local", "latent"), ("s3", "text")])  # each storage, each array
def test_a_flipped_byte_stops_training_until_verify_repair_and_a_rebuild(
    where, storage, setups, scan, tmp_path, s3_server
) -> None:
    model, built = setups(Family.SD)  # one shard: every rank reads from it
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    (shard,) = (cache / "shards").iterdir()
    flip_byte(shard, where)
    target, s3 = str(cache), []
    if storage == "s3":
        target, s3 = upload_cache(s3_client(s3_server), cache), ["--s3-endpoint-url", s3_server]
    train = ["--cache", target, "--scan", scan, "--model", model, "--max-steps", "2", *s3, *FAST]

    started = time.monotonic()
    proc = run_train([*train, "--output-dir", tmp_path / "run"], env=S3_ENV)
    elapsed = time.monotonic() - started
    assert proc.returncode == ExitCode.INCOMPLETE, proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s to stop"
    # every rank that reached the shard reports the same damage
    lines = {re.sub(r"^rank \d+ on \S+: ", "", line.split(" ERROR ", 1)[1]) for line in error_lines(proc.stderr)}
    assert len(lines) == 1, proc.stderr
    (line,) = lines
    assert f"shard {target}/shards/{shard.name} is damaged (sha256 " in line, line
    assert f"stk-cache verify {target} --repair" in line, line
    assert not (tmp_path / "run" / "final").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()

    proc = stk_cache(["verify", target, "--repair", *s3], env=S3_ENV)
    assert proc.returncode == ExitCode.INCOMPLETE and f"damaged shard: {shard.name}: sha256" in proc.stderr
    if storage == "s3":  # the rebuild and the rerun are the local case's: S3 changes only where bytes come from
        return
    proc = stk_cache([scan, "--model", model, "--out", target, "--dtype", "float32", "-q", *s3], env=S3_ENV)
    assert proc.returncode == 0, proc.stderr
    assert stk_cache(["verify", target, "--scan", scan, *s3], env=S3_ENV).returncode == 0
    proc = run_train([*train, "--output-dir", tmp_path / "rerun"], env=S3_ENV)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "rerun")] == [1, 2]


# --- the cache belongs to its model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> str:
    """Tiny SD model B: the family and configs of the setups' model A, other random weights."""
    from stk.models import build_tiny_model

    return build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("model-b") / "model"), seed=1)


def variant(model: str, tmp_path: Path, case: str, other: str) -> str:
    """Model A with one thing changed: its text encoder taken from B, or its VAE's scaling factor."""
    out = tmp_path / "variant"
    shutil.copytree(model, out)
    if case == "text-encoder":
        shutil.rmtree(out / "text_encoder")
        shutil.copytree(Path(other) / "text_encoder", out / "text_encoder")
    else:
        config = json.loads((out / "vae" / "config.json").read_text())
        (out / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
    return str(out)


OTHER_MODELS = {
    "other-weights": (2, ["(vae: weights; text_encoder: weights)"]),
    "text-encoder": (0, ["(text_encoder: weights)"]),
    "scaling-factor": (0, ["vae: config, scaling_factor 0.18215 in the cache, 0.5 in the model"]),
}


@pytest.mark.parametrize("case", list(OTHER_MODELS))
def test_a_cache_made_with_other_encoders_is_refused_naming_them_and_force_trains(
    case, setups, scan, tmp_path, other_weights
) -> None:
    ranks, messages = OTHER_MODELS[case]
    model, cache = setups(Family.SD)
    other = other_weights if case == "other-weights" else variant(model, tmp_path, case, other_weights)
    args = ["--cache", cache, "--scan", scan, "--model", other, "--max-steps", "1", *FAST]
    started = time.monotonic()
    proc = run_train([*args, "--output-dir", tmp_path / "run"], mpi=ranks, timeout=180)
    assert proc.returncode == ExitCode.INPUT, proc.stderr
    assert time.monotonic() - started < 120
    (line,) = error_lines(proc.stderr)
    assert f"{cache} was made with other model components than {other}" in line and "--force" in line, line
    for message in messages:
        assert message in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()
    if case == "other-weights":
        proc = run_train([*args, "--output-dir", tmp_path / "forced", "--force"], mpi=ranks)
        assert proc.returncode == 0, proc.stderr
        assert [r["step"] for r in metrics(tmp_path / "forced")] == [1]


def test_the_model_a_cache_was_made_with_trains_from_it(setups, scan, tmp_path) -> None:
    """The check passes on the cache's own model copied elsewhere (the path is not compared)."""
    model, cache = setups(Family.SD)
    moved = tmp_path / "moved-model"
    shutil.copytree(model, moved)
    proc = run_train(
        [
            "--cache",
            cache,
            "--scan",
            scan,
            "--model",
            moved,
            "--output-dir",
            tmp_path / "run",
            "--max-steps",
            "1",
            *FAST,
        ],
        mpi=0,
    )
    assert proc.returncode == 0, proc.stderr


# --- damaged inputs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated-scan-table", "missing-shard", "empty-shard"])
def test_a_damaged_scan_table_or_shard_is_exit_6_naming_the_file_and_what_rebuilds_it(
    damage, setups, scan, tmp_path
) -> None:
    """One line, exit 6 (as stk-cache verify says for the same damage), found before any model loads."""
    model, built = setups(Family.SD)
    cache, scan_copy = tmp_path / "cache", tmp_path / "scan"
    shutil.copytree(built, cache)
    shutil.copytree(scan, scan_copy)
    damaged = {
        "truncated-scan-table": scan_copy / "metadata.parquet",
        "missing-shard": sorted((cache / "shards").iterdir())[0],
        "empty-shard": sorted((cache / "shards").iterdir())[0],
    }[damage]
    if damage == "truncated-scan-table":
        damaged.write_bytes(damaged.read_bytes()[:100])
    elif damage == "missing-shard":
        damaged.unlink()
    else:
        damaged.write_bytes(b"")
    proc = run_train(
        [
            "--cache",
            cache,
            "--scan",
            scan_copy,
            "--model",
            model,
            "--output-dir",
            tmp_path / "run",
            "--max-steps",
            "1",
            *FAST,
        ],
        mpi=0,
        timeout=180,
    )
    assert proc.returncode == ExitCode.INCOMPLETE, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert f"{damaged} is damaged" in line, line
    fix = f"`stk-scan {json.loads((scan / 'summary.json').read_text())['source']} --out {scan_copy}`"
    assert (fix if damage == "truncated-scan-table" else f"`stk-cache verify {cache} --repair`") in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()
