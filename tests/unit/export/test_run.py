"""stk-export's refusals, each one line and exit 3 with nothing written: a folder that is not stk-train's final/ or
checkpoint, a format that cannot hold what it holds (DoRA, LoHa and LoKr name the formats that can), an output that
exists; and where it finds an adapter's family (a checkpoint's record, the run's latest checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.commands import one_error, stk_export

from stk.errors import ExitCode, InputError
from stk.export import ExportOptions, Format, export
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
