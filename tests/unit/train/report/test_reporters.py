"""stk.train.report.reporters: TensorBoard and W&B hold each step once across a resume; a missing wandb is refused."""

from __future__ import annotations

import json
import sys

import pytest
from support.train_outputs import board_scalars, board_tags

from stk.errors import InputError
from stk.train.report.metrics import MetricsLog


def test_tensorboard_holds_each_step_once_across_a_resume(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)  # tensorboard is the default
    log.start(0)
    for step in range(1, 8):
        log.write({"step": step, "epoch": 0.1 * step, "loss": 1.0 / step, "grad_norm": None, "time": 1e9 + step})
    log.close()  # killed after step 7; the last checkpoint was step 5
    log.start(5)
    for step in (6, 7, 8):
        log.write({"step": step, "loss": 10.0 + step, "time": 2e9 + step})
    log.close()
    loss = board_scalars(tmp_path / "tensorboard", "train/loss")
    assert [step for step, _ in loss] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [value for _, value in loss][4:] == pytest.approx([0.2, 16.0, 17.0, 18.0])
    assert board_tags(tmp_path / "tensorboard") == ["train/loss"]  # not the step, epoch, time, nor a None
    (tmp_path / "quiet").mkdir()
    quiet = MetricsLog(str(tmp_path / "quiet"), enabled=True, report_to="none")
    quiet.start(0)
    quiet.write({"step": 1, "loss": 1.0})
    quiet.close()
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["metrics.jsonl"]


def test_wandb_resumes_its_own_run_and_a_missing_wandb_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for resumed in (0, 2):
        log = MetricsLog(str(tmp_path), enabled=True, report_to="wandb")
        log.start(resumed)
        log.write({"step": resumed + 1, "loss": 1.0})
        log.close()
    run_id = (tmp_path / "wandb" / "stk-run-id").read_text().strip()
    runs = list(tmp_path.glob("wandb/offline-run-*"))  # two runs in one second: the second folder ends in "-1"
    assert len(runs) == 2 and all((run / f"run-{run_id}.wandb").is_file() for run in runs)
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package that is not installed
    with pytest.raises(InputError, match=r"wandb is not installed \(pip install 'stk\[wandb\]'\)"):
        MetricsLog(str(tmp_path / "other"), enabled=True, report_to="wandb")


def test_a_run_of_several_datasets_shows_a_loss_curve_per_dataset(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)
    log.start(0)
    for step, dataset in enumerate(["style", "photos", "style"], start=1):
        log.write({"step": step, "loss": float(step), "dataset": dataset, "time": 1e9 + step})
    log.close()
    board = tmp_path / "tensorboard"
    assert board_tags(board) == ["train/loss", "train/loss/photos", "train/loss/style"]
    assert board_scalars(board, "train/loss/style") == [(1, 1.0), (3, 3.0)]
    assert [json.loads(line)["dataset"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        "style",
        "photos",
        "style",
    ]
