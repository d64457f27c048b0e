"""stk-export's refusals, each one line and exit 3 with nothing written: a folder that is not stk-train's final/ or
checkpoint, a format that cannot hold what it holds (DoRA, LoHa and LoKr name the formats that can), an output that
exists; where it finds an adapter's family (a checkpoint's record, the run's latest checkpoint); and, on the session's
real run (`trained`), a file-size limit met while writing (exit 69, nothing left) and the scratch a killed export
leaves, which the rerun removes."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support.checkpoints import run_model, step_dir
from support.commands import one_error, stk_export

from stk.errors import ExitCode, InputError
from stk.export import ExportOptions, Format, export
from stk.export.run import scratch_of
from stk.export.source import read_source
from stk.models import Family


def adapter_file(folder: Path, mark: str = "lora_A") -> Path:
    """A final/'s adapter file with one tensor named as peft names `mark`'s (LoRA's lora_A, LoHa's hada_w1_a), in the
    file stk-train writes for it: diffusers' for LoRA and DoRA, peft's for LoHa and LoKr."""
    folder.mkdir(parents=True)
    name = (
        "pytorch_lora_weights.safetensors"
        if mark in ("lora_A", "lora_magnitude_vector")
        else "adapter_model.safetensors"
    )
    save_file({f"unet.down_blocks.0.attn.to_q.{mark}.weight": torch.zeros(2, 4)}, folder / name)
    return folder


def checkpoint(folder: Path, family: str = "sdxl", adapter: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "stk-run.json").write_text(json.dumps({"family": family, "lora_rank": 4 if adapter else 0}))
    if adapter:
        adapter_file(folder / "lora")
    return folder


def test_a_folder_that_is_not_stk_trains_is_one_line_exit_3(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    proc = stk_export(tmp_path / "other", tmp_path / "out.safetensors", "--format", "kohya")
    one_error(proc, ExitCode.INPUT, "not an stk-train final/ or checkpoint")
    assert not (tmp_path / "out.safetensors").exists()


def test_an_existing_output_is_one_line_exit_3(tmp_path: Path) -> None:
    final = adapter_file(tmp_path / "final")
    (tmp_path / "out.safetensors").write_bytes(b"mine")
    proc = stk_export(final, tmp_path / "out.safetensors", "--family", "sd")
    one_error(proc, ExitCode.INPUT, "already exists")
    assert (tmp_path / "out.safetensors").read_bytes() == b"mine"


@pytest.mark.parametrize(
    ("mark", "fmt", "says"),
    [
        ("hada_w1_a", Format.KOHYA, "cannot hold a loha adapter; formats that can: none .stk-train's final/ holds it"),
        ("lokr_w1", Format.DIFFUSERS, "cannot hold a lokr adapter; formats that can: none .stk-train's final/ holds"),
        ("lora_magnitude_vector", Format.KOHYA, "cannot hold a dora adapter; formats that can: diffusers"),
        ("lora_A", Format.SINGLE_FILE, "cannot hold a lora adapter; formats that can: diffusers, kohya"),
    ],
)
def test_a_format_that_cannot_hold_the_adapter_names_those_that_can(
    tmp_path: Path, mark: str, fmt: Format, says: str
) -> None:
    final = adapter_file(tmp_path / "final", mark)
    with pytest.raises(InputError, match=says):
        export(ExportOptions(str(final), str(tmp_path / "out.safetensors"), fmt, Family.SD))
    assert not (tmp_path / "out.safetensors").exists()


def test_a_full_fine_tune_names_single_file(tmp_path: Path) -> None:
    final = tmp_path / "final"
    final.mkdir()
    (final / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(InputError, match="cannot hold a full fine-tune; formats that can: single-file"):
        export(ExportOptions(str(final), str(tmp_path / "out.safetensors"), Format.KOHYA))


def test_a_full_fine_tunes_checkpoint_needs_the_model(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "step-00000004", adapter=False)
    with pytest.raises(InputError, match=r"holds the denoiser alone; give --model"):
        export(ExportOptions(str(folder), str(tmp_path / "out.safetensors"), Format.SINGLE_FILE))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_the_family_comes_from_the_checkpoint_or_the_runs_latest(tmp_path: Path) -> None:
    assert read_source(str(checkpoint(tmp_path / "a" / "step-00000002")), None).family is Family.SDXL
    run = tmp_path / "run"
    checkpoint(run / "checkpoints" / "step-00000004", family="flux")
    (run / "checkpoints" / "latest").write_text("step-00000004")
    assert read_source(str(adapter_file(run / "final")), None).family is Family.FLUX
    assert read_source(str(run / "final"), Family.SD).family is Family.SD  # --family wins
    with pytest.raises(InputError, match="family is not recorded beside it; pass --family"):
        read_source(str(adapter_file(tmp_path / "alone")), None)


# --- the disk, and an export killed midway -------------------------------------------------------------------------

FILE_LIMIT = 64 * 1024  # bytes (ulimit -f): above the tiny SD's tokenizer (13 KB), below its text encoder (150 KB)


def test_a_file_over_the_size_limit_is_one_line_exit_69_and_nothing_is_left(
    trained: tuple[list[Any], Path], tmp_path: Path
) -> None:
    """EFBIG (the process's ulimit -f, or a file system's largest file) while OUT is written: a traceback before."""
    _, run = trained
    file = tmp_path / "m.safetensors"
    proc = stk_export(run / "final", file, "--format", "single-file", file_limit=FILE_LIMIT)
    one_error(proc, ExitCode.INFRA, f"cannot write {file}: the file is larger than", "file-size limit (ulimit -f)")
    assert not list(tmp_path.iterdir())


def test_the_scratch_of_a_killed_export_goes_on_the_rerun(trained: tuple[list[Any], Path], tmp_path: Path) -> None:
    """A full fine-tune's checkpoint is made a whole pipeline beside OUT first: killed while copying it (SIGXFSZ at
    the limit, as a SIGKILL would), the export leaves it; the next export to OUT removes it and writes OUT."""
    args, run = trained
    model, file = run_model(args), tmp_path / "m.safetensors"
    source = step_dir(run, 4)
    proc = stk_export(source, file, "--format", "single-file", "--model", model, file_limit=FILE_LIMIT, killed=True)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr
    assert any(scratch_of(file).rglob("model_index.json")), "no pipeline left to remove"
    export(ExportOptions(str(source), str(file), Format.SINGLE_FILE, model=model))
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
