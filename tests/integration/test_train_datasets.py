"""Two datasets end to end, as users run them: stk-scan --datasets, stk-cache, stk-train. One epoch trains each
dataset's images times its repeats, each at its own resolution, and metrics.jsonl names each step's dataset."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest
from support.commands import FAST, cache_command, run_train, scan_command, scan_env, summary_of
from support.train_outputs import metrics

from stk.datagen import generate_dataset
from stk.models import Family, build_tiny_model
from stk.shards import CacheReader

pytestmark = pytest.mark.integration

STYLE, PHOTOS, REPEATS = 4, 6, 5  # images of each, the style set's repeats


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        command, capture_output=True, text=True, env={**scan_env(), "OMP_NUM_THREADS": "1"}, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_one_epoch_trains_each_dataset_times_its_repeats_at_its_own_resolution(tmp_path: Path) -> None:
    generate_dataset(str(tmp_path / "style"), STYLE, seed=1, min_side=64, max_side=80)
    generate_dataset(str(tmp_path / "photos"), PHOTOS, seed=2, min_side=64, max_side=80)
    listed = tmp_path / "datasets.toml"
    listed.write_text(
        f'[[dataset]]\nname = "style"\nsource = "{tmp_path / "style"}"\nrepeats = {REPEATS}\ncrop = "random"\n\n'
        f'[[dataset]]\nname = "photos"\nsource = "{tmp_path / "photos"}"\nresolution = 128\n'
    )
    scan, cache = tmp_path / "scan", tmp_path / "cache"
    _run(
        scan_command(
            [
                "--datasets",
                listed,
                "--out",
                scan,
                "--resolution",
                64,
                "--alignment",
                64,
                "--batch-size",
                2,
                "--gpus",
                1,
                "--missing-caption",
                "empty",
                "-q",
            ]
        )
    )
    model = build_tiny_model(Family.SD, str(tmp_path / "sd"))
    _run(cache_command([scan, "--model", model, "--out", cache, "--dtype", "float32", "-q"]))
    with CacheReader(str(cache)) as reader:  # each dataset at its own resolution: one latent shape each
        assert sorted((hw, len(keys)) for hw, keys in reader.bucket_keys().items()) == [((8, 8), STYLE), ((16, 16), 6)]

    out = tmp_path / "run"
    proc = run_train(
        [
            "--cache",
            cache,
            "--scan",
            scan,
            "--model",
            model,
            "--output-dir",
            out,
            "--no-validation",
            *FAST[:-1],
            "--batch-size",
            2,
        ],
        mpi=0,
    )
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["samples_per_dataset"] == {"photos": PHOTOS, "style": STYLE * REPEATS}
    assert summary["steps"] == (PHOTOS + STYLE * REPEATS) // 2  # one epoch, every sample once
    steps = [row["dataset"] for row in metrics(out) if "loss" in row]
    assert Counter(steps) == {"style": STYLE * REPEATS // 2, "photos": PHOTOS // 2}
