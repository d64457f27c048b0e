"""Checkpoints that can be trusted: every file's sha256 in stk-run.json, written last; a resume that verifies the
checkpoint it takes and falls back to the newest one that verifies; a save that fails anywhere ends every rank
with one line and exit 69, `latest` where it was.

One real 2-rank run (module fixture) trains 4 steps with a checkpoint at steps 2 and 4 and an EMA; the damage
cases work on copies of its output: most through `CheckpointDir.resolve` in this process (what a resume does
before any model loads), one damaged resume, one refusal and one disk that fills mid-save through real 2-rank
runs. The parts of a save that fail are also driven in this process, with writers that fail, on a 1-rank
process group."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.helpers import FAST, metrics, one_error, run_train, summary_of, train_command, train_env

from stk.errors import CheckpointDamaged, InfraError, InputError
from stk.models import Family
from stk.train.checkpoint import LATEST, SETTINGS, CheckpointDir, Resume
from stk.world import World

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
LOUD = [a for a in FAST if a != "-q"]  # the skipped checkpoints are warnings


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def record(out: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(out, step) / SETTINGS).read_text())


@pytest.fixture(scope="module")
def trained(setups, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """(the run's arguments less --output-dir and --max-steps, its output): 4 steps on 2 ranks, checkpoints at 2
    and 4 (both kept), an EMA sharded over the ranks."""
    model, cache = setups(Family.SD)
    args = ["--cache", cache, "--model", model, "--checkpoint-every", "2", "--keep-checkpoints", "2",
            "--ema-decay", "0.8", "--no-validation", *LOUD]  # fmt: skip
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run_train([*args, "--output-dir", out, "--max-steps", "4"])
    assert proc.returncode == 0, proc.stderr
    return args, out


@pytest.fixture
def copied(trained: tuple[list[Any], Path], tmp_path: Path) -> tuple[list[Any], Path]:
    args, out = trained
    copy = tmp_path / "run"
    shutil.copytree(out, copy, symlinks=True)
    return args, copy


def resolve(out: Path, resume: str = "auto") -> Resume | None:
    """What a resume takes, in this process (a world of one verifies every file)."""
    return CheckpointDir(str(out), keep=2, rank=0).resolve(resume, World())


def overwrite(path: Path, offset: int = 4096, size: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size))


# --- what a save records ------------------------------------------------------------------------------------------


def test_every_file_of_a_checkpoint_is_listed_with_its_size_digest_and_writer(trained):
    _, out = trained
    for step in (2, 4):
        files = record(out, step)["files"]
        on_disk = {str(p.relative_to(step_dir(out, step))) for p in step_dir(out, step).rglob("*") if p.is_file()} - {
            SETTINGS
        }
        assert set(files) == on_disk, on_disk ^ set(files)
        assert {MODEL, OPTIM.format(0), OPTIM.format(1), "ema/rank-00000.pt", "ema/rank-00001.pt"} <= set(files)
        assert files[OPTIM.format(1)]["rank"] == 1 and files["ema/rank-00001.pt"]["rank"] == 1
        assert files[MODEL]["size"] == (step_dir(out, step) / MODEL).stat().st_size
    assert (out / "checkpoints" / LATEST).read_text() == "step-00000004"


# --- resume: damaged checkpoints, in this process ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: overwrite(d / MODEL), "sha256"),  # bytes overwritten in the model states
        (lambda d: overwrite(d / OPTIM.format(0)), "sha256"),  # ... in the optimizer states
        (lambda d: os.truncate(d / MODEL, 1000), "1000 bytes"),  # a truncated file
        (lambda d: os.truncate(d / OPTIM.format(1), 0), "0 bytes"),  # a zero-byte file on one rank
        (lambda d: (d / "ema" / "rank-00001.pt").unlink(), "missing"),  # a missing EMA part
    ],
    ids=["model-bytes", "optimizer-bytes", "truncated", "zero-bytes-rank-1", "missing-ema"],
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one_naming_the_file(damage, expected, copied, caplog):
    _, out = copied
    damage(step_dir(out, 4))
    with caplog.at_level(logging.WARNING):
        taken = resolve(out)
    assert taken == Resume(str(out / "checkpoints"), "step-00000002")
    skipped = [r.getMessage() for r in caplog.records if "damaged, skipped" in r.getMessage()]
    assert len(skipped) == 1 and str(step_dir(out, 4)) in skipped[0] and expected in skipped[0], skipped


def test_no_checkpoint_that_verifies_is_exit_6_naming_each_file(copied):
    _, out = copied
    os.truncate(step_dir(out, 4) / MODEL, 10)
    overwrite(step_dir(out, 2) / OPTIM.format(1))
    with pytest.raises(CheckpointDamaged) as caught:
        resolve(out)
    message = str(caught.value)
    assert caught.value.exit_code == 6 and "\n" not in message
    assert str(step_dir(out, 4) / MODEL) in message and str(step_dir(out, 2) / OPTIM.format(1)) in message
    assert "--resume-from" in message and "--resume none" in message


def test_latest_naming_a_missing_folder_falls_back_to_the_newest_that_verifies(copied, caplog):
    _, out = copied
    (out / "checkpoints" / LATEST).write_text("step-00000009")
    with caplog.at_level(logging.WARNING):
        assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000004")
    assert any("names 'step-00000009', which is not there" in r.getMessage() for r in caplog.records)
    assert not any("remove" in r.getMessage() for r in caplog.records)  # never advice that loses good checkpoints
    shutil.rmtree(step_dir(out, 4))
    assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000002")


def test_resume_from_picks_one_by_hand_and_refuses_it_damaged(copied):
    _, out = copied
    assert resolve(out, str(step_dir(out, 2))) == Resume(str(out / "checkpoints"), "step-00000002")
    overwrite(step_dir(out, 2) / MODEL)
    with pytest.raises(CheckpointDamaged, match="--resume-from: the checkpoint is damaged"):
        resolve(out, str(step_dir(out, 2)))
    with pytest.raises(InputError, match="no such checkpoint directory"):
        resolve(out, str(out / "nowhere"))
    assert resolve(out, "none") is None


def test_a_checkpoint_saved_without_digests_resumes_with_one_warning(copied, caplog):
    _, out = copied
    path = step_dir(out, 4) / SETTINGS
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "files"}))
    with caplog.at_level(logging.WARNING):
        assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000004")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "records no digests" in warnings[0], warnings


def test_a_torn_record_is_damage(copied):
    _, out = copied
    path = step_dir(out, 4) / SETTINGS
    path.write_bytes(path.read_bytes()[:50])
    assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000002")


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
        capture_output=True, text=True, env=train_env(), timeout=300,
    )  # fmt: skip
    line = one_error(proc, 69, "no space left on the device", str(step_dir(out, 6)))
    assert "stopping all" not in line  # agreed by every rank, not one rank's abort
    assert (out / "checkpoints" / LATEST).read_text() == "step-00000004"
    assert not step_dir(out, 6).exists()  # the torn checkpoint removed, its space given back

    (disk / "filler").unlink()
    rerun = run_train([*args, "--output-dir", out, "--max-steps", "6"])
    assert rerun.returncode == 0, rerun.stderr
    assert summary_of(rerun)["resumed_from"].endswith("step-00000004")


# --- a save that fails: each part, with writers that fail, in this process -----------------------------------------


class _Engine:
    """What CheckpointDir.save asks of a DeepSpeed engine: files written through its checkpoint engine."""

    def __init__(self, fail: str | None, exc: Exception) -> None:
        self.checkpoint_engine = _Writer(fail, exc)

    def save_checkpoint(self, save_dir: str, tag: str, **_: Any) -> None:
        self.checkpoint_engine.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        self.checkpoint_engine.save({"w": torch.ones(4)}, os.path.join(save_dir, tag, MODEL))
        self.checkpoint_engine.save({"adam": torch.ones(4)}, os.path.join(save_dir, tag, OPTIM.format(0)))


class _Writer:
    def __init__(self, fail: str | None, exc: Exception) -> None:
        self.fail, self.exc = fail, exc

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state: Any, path: str) -> None:
        if self.fail and self.fail in path:
            with open(path, "wb") as f:
                f.write(b"part")
            raise self.exc
        torch.save(state, path)


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    from stk.slurm import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _also(fail: str | None, exc: Exception) -> Any:
    """The EMA and LoRA parts, as loop._beside_checkpoint writes them."""

    def write(folder: str) -> list[str]:
        written = []
        for part in ("ema/rank-00000.pt", "lora/pytorch_lora_weights.safetensors"):
            path = os.path.join(folder, part)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if fail == part.split("/")[0]:
                raise exc
            torch.save({"x": torch.zeros(2)}, path)
            written.append(path)
        return written

    return write


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
EACCES = PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.parametrize(
    ("part", "exc"),
    [
        ("model_states", ENOSPC),
        ("optim_states", ENOSPC),
        ("ema", ENOSPC),
        ("lora", ENOSPC),
        ("optim_states", EACCES),  # a permission lost mid-run: the infrastructure's, as a full disk (not exit 3)
        ("lora", EACCES),
    ],
)
def test_each_part_of_a_save_that_fails_is_exit_69_and_latest_stays(part, exc, one_rank, tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), keep=2, rank=0)
    checkpoints.save(_Engine(None, exc), 2, {}, {"seed": 0}, also=_also(None, exc))
    assert resolve(tmp_path) == Resume(checkpoints.path, "step-00000002")
    engine = _Engine(part if part.endswith("states") else None, exc)
    with pytest.raises(InfraError) as caught:
        checkpoints.save(engine, 4, {}, {"seed": 0}, also=_also(part, exc))
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value)
    assert (tmp_path / "checkpoints" / LATEST).read_text() == "step-00000002"
    assert not step_dir(tmp_path, 4).exists()
    assert isinstance(engine.checkpoint_engine, _Writer)  # DeepSpeed's own engine given back


def test_a_record_that_cannot_be_written_leaves_latest(one_rank, tmp_path, monkeypatch):
    import stk.train.checkpoint as checkpoint

    checkpoints = CheckpointDir(str(tmp_path), keep=2, rank=0)
    checkpoints.save(_Engine(None, ENOSPC), 2, {}, {"seed": 0})

    def full(location: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", location)

    monkeypatch.setattr(checkpoint, "write_atomic", full)
    with pytest.raises(InfraError, match=SETTINGS):
        checkpoints.save(_Engine(None, ENOSPC), 4, {}, {"seed": 0})
    assert (tmp_path / "checkpoints" / LATEST).read_text() == "step-00000002"
