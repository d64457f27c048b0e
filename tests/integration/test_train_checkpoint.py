"""Checkpoints that can be trusted, through real 2-rank runs: a damaged checkpoint on one rank resumes from the
previous one and trains the same steps, no good checkpoint is exit 6 before any model loads, and a disk that fills
while the EMA is saved is exit 69 on every rank with `latest` where it was. The run they share is the `trained`
fixture; the checks in this process: tests/unit/train/checkpoint/test_store.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from support.checkpoints import MODEL, OPTIM, record, resolve, step_dir
from support.commands import one_error, run_train, summary_of, train_command, train_env
from support.train_outputs import metrics

from stk.train.checkpoint.store import LATEST, Resume

# --- resume: real 2-rank runs -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_damaged_checkpoint_on_one_rank_resumes_from_the_previous_one_and_trains_the_same_steps(copied, trained):
    args, out = copied
    os.truncate(step_dir(out, 4) / OPTIM.format(1), 0)  # rank 1's share: found by rank 1, agreed by both
    proc = run_train([*args, "--output-dir", out, "--max-steps", "4"])
    assert proc.returncode == 0, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if "damaged, skipped" in line]
    assert len(skipped) == 1 and f"{OPTIM.format(1)}: 0 bytes" in skipped[0], proc.stderr
    assert summary_of(proc)["resumed_from"].endswith("step-00000002")
    # the steps after the good checkpoint trained again, exactly as the first time (not on damaged state)
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(trained[1])]
    assert (out / "checkpoints" / LATEST).read_text() == "step-00000004"
    assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000004")  # saved again, whole


@pytest.mark.integration
def test_no_good_checkpoint_is_exit_6_before_any_model_loads(copied):
    args, out = copied
    os.truncate(step_dir(out, 4) / MODEL, 0)
    (step_dir(out, 2) / "ema" / "rank-00000.pt").unlink()
    started = time.monotonic()
    proc = run_train([*args, "--output-dir", out, "--max-steps", "6"])
    one_error(proc, 6, str(step_dir(out, 4) / MODEL), str(step_dir(out, 2) / "ema" / "rank-00000.pt"))
    assert time.monotonic() - started < 120
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


# --- a save that fails: a full disk under 2 real ranks ------------------------------------------------------------


@pytest.mark.integration
def test_a_disk_that_fills_while_the_ema_is_saved_is_exit_69_on_every_rank_and_latest_stays(trained, mount):
    args, trained_out = trained
    disk = mount("disk", "size=256m")
    out = disk / "run"
    shutil.copytree(trained_out, out, symlinks=True)
    sizes = {name: r["size"] for name, r in record(out, 4)["files"].items()}
    deepspeed_files = sum(size for name, size in sizes.items() if not name.startswith("ema/"))
    ema_one_rank = sizes["ema/rank-00000.pt"]
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * (free - deepspeed_files - ema_one_rank - 64 * 1024))
    proc = subprocess.run(
        train_command([*args, "--output-dir", out, "--max-steps", "6"], 2),
        capture_output=True,
        text=True,
        env=train_env(),
        timeout=300,
    )
    line = one_error(proc, 69, "no space left on the device", str(step_dir(out, 6)))
    assert "stopping all" not in line  # agreed by every rank, not one rank's abort
    assert (out / "checkpoints" / LATEST).read_text() == "step-00000004"
    assert not step_dir(out, 6).exists()  # the torn checkpoint removed, its space given back

    (disk / "filler").unlink()
    rerun = run_train([*args, "--output-dir", out, "--max-steps", "6"])
    assert rerun.returncode == 0, rerun.stderr
    assert summary_of(rerun)["resumed_from"].endswith("step-00000004")
