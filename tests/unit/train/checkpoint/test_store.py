"""stk.train.checkpoint.store: every file's sha256 in stk-run.json, written last; a resume that verifies the checkpoint
it takes and falls back to the newest one that verifies; a save that fails anywhere is exit 69 with `latest` where it
was; the settings a resume may not change; pruning and resume resolution.

The damage cases work on copies of one real 2-rank run (the `trained` fixture: 4 steps, checkpoints at 2 and 4, an
EMA) through `CheckpointDir.resolve` in this process (what a resume does before any model loads). The parts of a
save that fail are driven in this process, with writers that fail, on a 1-rank process group. Real resumes:
tests/integration/test_train_checkpoint.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from support.checkpoints import MODEL, OPTIM, record, resolve, step_dir, without_digests

from stk.cluster.world import World
from stk.errors import CheckpointDamaged, InfraError, InputError
from stk.models import Family
from stk.train.checkpoint.digests import SETTINGS
from stk.train.checkpoint.store import LATEST, CheckpointDir, Resume, tag_for
from stk.train.objective.losses import LossSettings
from stk.train.options import TrainOptions
from stk.train.trainable.lora import LoraSettings


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


class _Globals(pickle.Unpickler):
    """Records every class or function a pickle names, loading nothing of its own."""

    named: ClassVar[set[str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        _Globals.named.add(f"{module}.{name}")
        return super().find_class(module, name)


def test_a_checkpoint_names_no_stk_module_so_moving_one_keeps_old_checkpoints_loading(trained):
    """What a checkpoint pickles (DeepSpeed's model and optimizer states, the EMA's shares) names torch's, numpy's
    and DeepSpeed's classes only, never one of stk's: stk's modules can move between releases and a run made before
    still resumes. The record and the run's settings are JSON."""
    _, out = trained
    pickles = sorted(p for p in step_dir(out, 4).rglob("*.pt"))
    assert {MODEL, OPTIM.format(0), "ema/rank-00000.pt"} <= {str(p.relative_to(step_dir(out, 4))) for p in pickles}
    _Globals.named.clear()
    shim = types.SimpleNamespace(Unpickler=_Globals, load=pickle.load, __name__="pickle")
    for path in pickles:
        torch.load(path, map_location="cpu", weights_only=False, pickle_module=shim)
    assert any(name.startswith("torch.") for name in _Globals.named)  # the recording works
    assert not [name for name in _Globals.named if name.startswith("stk.")]


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
    without_digests(step_dir(out, 4))
    with caplog.at_level(logging.WARNING):
        assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000004")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "records no digests" in warnings[0], warnings


def test_a_torn_record_is_damage(copied):
    _, out = copied
    path = step_dir(out, 4) / SETTINGS
    path.write_bytes(path.read_bytes()[:50])
    assert resolve(out) == Resume(str(out / "checkpoints"), "step-00000002")


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

    from stk.cluster.slurm import free_port

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
    import stk.train.checkpoint.store as checkpoint

    checkpoints = CheckpointDir(str(tmp_path), keep=2, rank=0)
    checkpoints.save(_Engine(None, ENOSPC), 2, {}, {"seed": 0})

    def full(location: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", location)

    monkeypatch.setattr(checkpoint, "write_atomic", full)
    with pytest.raises(InfraError, match=SETTINGS):
        checkpoints.save(_Engine(None, ENOSPC), 4, {}, {"seed": 0})
    assert (tmp_path / "checkpoints" / LATEST).read_text() == "step-00000002"


# --- the settings a checkpoint was trained with -------------------------------------------


def settings(world_size: int = 2, **changes: object) -> dict[str, object]:
    return replace(TrainOptions(model="m", output_dir="o"), **changes).run_settings(Family.SDXL, world_size)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointDir, Resume]:
    checkpoints = CheckpointDir(str(tmp_path), keep=1, rank=0)
    (tmp_path / "checkpoints" / "step-00000005").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000005" / "stk-run.json").write_text(json.dumps(settings()))
    return checkpoints, Resume(checkpoints.path, "step-00000005")


def test_same_settings_resume_quietly(saved):
    checkpoints, resume = saved
    assert checkpoints.check_settings(resume, settings(), override=False) == []


def test_other_seed_or_batch_is_refused_naming_old_and_new(saved):
    checkpoints, resume = saved
    with pytest.raises(InputError, match=r"seed 0 -> 3, batch-size 4 -> 2\).*--override-resume"):
        checkpoints.check_settings(resume, settings(seed=3, batch_size=2), override=False)


def test_another_split_of_the_same_effective_batch_is_no_change(saved):
    checkpoints, resume = saved  # 2 ranks x 4 x 1
    assert checkpoints.check_settings(resume, settings(world_size=1, grad_accum=2), override=False) == []
    with pytest.raises(InputError, match=r"grad-accum 1 -> 2, world-size 2 -> 3\).*--override-resume"):
        checkpoints.check_settings(resume, settings(world_size=3, grad_accum=2), override=False)
    assert checkpoints.check_settings(resume, settings(world_size=3), override=True) == ["world_size"]


def test_override_returns_what_changed(saved):
    checkpoints, resume = saved
    assert checkpoints.check_settings(resume, settings(seed=3), override=True) == ["seed"]


def test_another_family_is_refused_even_with_override(saved):
    checkpoints, resume = saved
    flux = {**settings(), "family": Family.FLUX.value}
    with pytest.raises(InputError, match="other weights"):
        checkpoints.check_settings(resume, flux, override=True)


def test_another_base_precision_is_refused_unless_overridden(saved):
    checkpoints, resume = saved
    with pytest.raises(InputError, match=r"\(base-precision bf16 -> int8\).*--override-resume"):
        checkpoints.check_settings(resume, settings(base_precision="int8"), override=False)
    assert checkpoints.check_settings(resume, settings(base_precision="int8"), override=True) == ["base_precision"]


def test_a_record_from_before_the_examples_defaults_names_the_sampling_that_changed(tmp_path: Path) -> None:
    """A FLUX.1 checkpoint of the old defaults (logit-normal, flow_shift null: the pipeline's shift) resumes with those
    given, and is refused by the new defaults naming what changed."""
    checkpoints = CheckpointDir(str(tmp_path), keep=1, rank=0)
    folder = tmp_path / "checkpoints" / "step-00000005"
    folder.mkdir(parents=True)
    flux = TrainOptions(model="m", output_dir="o")
    old = {**flux.run_settings(Family.FLUX, 2), "timestep_sampling": "logit-normal", "flow_shift": None}
    (folder / "stk-run.json").write_text(json.dumps(old))
    resume = Resume(checkpoints.path, "step-00000005")
    as_before = replace(flux, loss=LossSettings(timestep_sampling="logit-normal", flow_shift="auto"))
    assert checkpoints.check_settings(resume, as_before.run_settings(Family.FLUX, 2), override=False) == []
    with pytest.raises(InputError, match=r"timestep-sampling logit-normal -> uniform, flow-shift auto -> example"):
        checkpoints.check_settings(resume, flux.run_settings(Family.FLUX, 2), override=False)


def test_a_full_checkpoint_resumed_as_a_lora_is_refused_even_with_override(saved):
    checkpoints, resume = saved
    with pytest.raises(InputError, match=re.escape("it holds other weights (lora-rank 0 -> 16)")):
        checkpoints.check_settings(resume, settings(lora=LoraSettings(rank=16)), override=True)


STYLE = {"name": "style", "repeats": 10, "weight": 2.0, "caption_dropout": 0.1}
PHOTOS = {"name": "photos", "repeats": 1, "weight": 1.0, "caption_dropout": None}


@pytest.mark.parametrize(
    ("datasets", "named"),
    [
        ([{**STYLE, "repeats": 5}, PHOTOS], "dataset 'style': repeats 10 -> 5"),
        ([STYLE, {**PHOTOS, "weight": 3.0}], "dataset 'photos': weight 1.0 -> 3.0"),
        ([STYLE, {**PHOTOS, "caption_dropout": 0.2}], "dataset 'photos': caption-dropout None -> 0.2"),
        ([STYLE], "dataset 'photos' removed"),
        ([STYLE, PHOTOS, {**PHOTOS, "name": "more"}], "dataset 'more' added"),
        ([], "dataset 'style' removed, dataset 'photos' removed"),  # resumed from one source
    ],
)
def test_a_changed_dataset_list_is_refused_naming_what_changed(saved, tmp_path, datasets, named):
    checkpoints, resume = saved
    (Path(resume.directory) / resume.tag / "stk-run.json").write_text(
        json.dumps({**settings(), "datasets": [STYLE, PHOTOS]})
    )
    current = {**settings(), "datasets": datasets} if datasets else settings()
    with pytest.raises(InputError, match=re.escape(f"({named}): rerun with the checkpoint's values")):
        checkpoints.check_settings(resume, current, override=False)
    assert checkpoints.check_settings(resume, current, override=True) == ["datasets"]
    reordered = {**settings(), "datasets": [PHOTOS, STYLE]}  # the sampler draws by name: no change
    assert checkpoints.check_settings(resume, reordered, override=False) == []


def test_a_checkpoint_of_one_source_resumed_with_datasets_is_refused(saved):
    checkpoints, resume = saved  # its record has no datasets, as before there were any
    with pytest.raises(InputError, match=re.escape("(dataset 'style' added)")):
        checkpoints.check_settings(resume, {**settings(), "datasets": [STYLE]}, override=False)


@pytest.fixture
def saved_lora(saved: tuple[CheckpointDir, Resume], tmp_path: Path) -> tuple[CheckpointDir, Resume]:
    record = tmp_path / "checkpoints" / "step-00000005" / "stk-run.json"
    record.write_text(json.dumps(settings(lora=LoraSettings(rank=16))))
    return saved


@pytest.mark.parametrize(
    ("lora", "differs"),
    [
        (LoraSettings(), "lora-rank 16 -> 0"),
        (LoraSettings(rank=8), "lora-rank 16 -> 8, lora-alpha 16 -> 8"),  # alpha: the rank, unless given
        (LoraSettings(rank=16, targets=("to_q",)), "lora-targets ['to_k', 'to_out.0', 'to_q', 'to_v'] -> ['to_q']"),
        (LoraSettings(rank=16, adapter="loha"), "adapter lora -> loha"),
        (LoraSettings(rank=16, dora=True), "dora False -> True"),
    ],
)
def test_a_lora_checkpoint_resumed_with_other_adapter_weights_is_refused_even_with_override(saved_lora, lora, differs):
    checkpoints, resume = saved_lora
    with pytest.raises(InputError, match=re.escape(f"it holds other weights ({differs})")):
        checkpoints.check_settings(resume, settings(lora=lora), override=True)


@pytest.mark.parametrize(
    ("lora", "differs"),
    [(LoraSettings(rank=16, adapter="lokr"), "adapter lora -> lokr"), (LoraSettings(rank=16), None)],
)
def test_a_record_from_before_adapter_kinds_holds_a_plain_lora(saved, tmp_path, lora, differs):
    checkpoints, resume = saved
    record = settings(lora=LoraSettings(rank=16))
    del record["adapter"], record["dora"]
    (tmp_path / "checkpoints" / "step-00000005" / "stk-run.json").write_text(json.dumps(record))
    if differs is None:
        assert checkpoints.check_settings(resume, settings(lora=lora), override=False) == []
        return
    with pytest.raises(InputError, match=re.escape(f"it holds other weights ({differs})")):
        checkpoints.check_settings(resume, settings(lora=lora), override=True)


def test_a_lora_resumed_with_another_alpha_needs_override_like_any_setting(saved_lora):
    checkpoints, resume = saved_lora
    other = settings(lora=LoraSettings(rank=16, alpha=32))
    with pytest.raises(InputError, match=re.escape("lora-alpha 16 -> 32") + ".*--override-resume"):
        checkpoints.check_settings(resume, other, override=False)
    assert checkpoints.check_settings(resume, other, override=True) == ["lora_alpha"]


def test_checkpoints_without_the_record_are_not_checked(saved, tmp_path):
    checkpoints, resume = saved
    (tmp_path / "checkpoints" / "step-00000005" / "stk-run.json").unlink()
    assert checkpoints.check_settings(resume, settings(seed=9), override=False) == []


def test_prune_keeps_the_newest_complete_and_drops_torn_newer_ones(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), keep=2, rank=0)
    for step in (1, 2, 3, 9):
        (tmp_path / "checkpoints" / tag_for(step)).mkdir(parents=True)
    checkpoints._prune(keep_tag=tag_for(3))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [tag_for(2), tag_for(3)]


def test_resume_resolution(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), keep=1, rank=0)
    assert checkpoints.resolve("auto", World()) is None and checkpoints.resolve("none", World()) is None
    (tmp_path / "checkpoints" / tag_for(4)).mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text(tag_for(4))
    resume = checkpoints.resolve("auto", World())  # saved without digests: resumed as it is (with a warning)
    assert resume is not None and resume.tag == tag_for(4) and resume.directory == checkpoints.path
    assert checkpoints.resolve(str(tmp_path / "checkpoints" / tag_for(4)), World()) == resume
    (tmp_path / "checkpoints" / "latest").write_text(tag_for(5))
    with pytest.raises(CheckpointDamaged, match="not there, and no other checkpoint lists its files"):
        checkpoints.resolve("auto", World())
    with pytest.raises(InputError, match="keep at least 1"):
        CheckpointDir(str(tmp_path), keep=0, rank=0)
