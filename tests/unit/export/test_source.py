"""stk.export.source on real stk-train outputs (the session's `trained`: a full fine-tune of the tiny SD on 2 ranks,
checkpoints at steps 2 and 4; `sdxl`: a tiny SDXL pipeline, as a full fine-tune's final/ holds one), damaged or given
the wrong family in copies: a checkpoint is verified against the sha256 of its stk-run.json as a resume verifies it
(exit 6 naming the file), and a --family that the source's own record contradicts is one line (exit 3)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.bad_inputs import DAMAGED_SAFETENSORS
from support.checkpoints import MODEL, OPTIM, run_model, step_dir, without_digests

from stk.errors import CheckpointDamaged, InputError
from stk.export import ExportOptions, Format, export
from stk.models import Family


def overwrite(path: Path, offset: int = 4096, size: int = 64) -> None:
    """Bytes changed in place: the file keeps its size, so only its sha256 tells."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda d: overwrite(d / MODEL), f"{MODEL}: sha256 "),
        (lambda d: os.truncate(d / OPTIM.format(1), 1000), f"{OPTIM.format(1)}: 1000 bytes, "),
    ],
    ids=["bytes-changed", "optimizer-states-truncated"],
)
def test_a_checkpoint_that_does_not_match_its_digests_is_exit_6_before_any_model_loads(
    copied: tuple[list[Any], Path], tmp_path: Path, damage: Any, says: str
) -> None:
    args, out = copied
    damage(step_dir(out, 4))
    opts = ExportOptions(
        str(step_dir(out, 4)), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, model=run_model(args)
    )
    with pytest.raises(CheckpointDamaged, match=f"the checkpoint is damaged .*{says}.*export another checkpoint"):
        export(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_checkpoint_without_digests_is_exported_with_a_warning(
    copied: tuple[list[Any], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved by an older stk: nothing to verify it by, said once."""
    args, out = copied
    without_digests(step_dir(out, 4))
    with caplog.at_level(logging.WARNING):
        export(
            ExportOptions(
                str(step_dir(out, 4)), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, model=run_model(args)
            )
        )
    assert (tmp_path / "m.safetensors").is_file()
    assert any("records no digests" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("damage", "says"), DAMAGED_SAFETENSORS)
def test_a_damaged_weights_file_of_a_final_pipeline_is_exit_6_naming_it(
    sdxl: Path, tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    final = Path(shutil.copytree(sdxl, tmp_path / "final"))
    file = final / "unet" / "diffusion_pytorch_model.safetensors"
    damage(file)
    with pytest.raises(CheckpointDamaged, match=f"{file}: damaged, not a whole safetensors file .*{says}"):
        export(ExportOptions(str(final), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_full_fine_tunes_final_given_another_family_is_refused(sdxl: Path, tmp_path: Path) -> None:
    """An SDXL final/ with --family sd (written before, through SD's layout): the pipeline's record wins."""
    with pytest.raises(InputError, match=r"holds SDXL's pipeline \(its model_index.json\), not --family sd's"):
        export(ExportOptions(str(sdxl), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, Family.SD))
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_given_another_family_is_refused(trained: tuple[list[Any], Path], tmp_path: Path) -> None:
    args, out = trained
    folder, file = str(step_dir(out, 4)), str(tmp_path / "m.safetensors")
    opts = ExportOptions(folder, file, Format.SINGLE_FILE, Family.SDXL, run_model(args))
    with pytest.raises(InputError, match=r"the checkpoint trained sd \(its stk-run.json\), not --family sdxl"):
        export(opts)
    assert not list(tmp_path.iterdir())
