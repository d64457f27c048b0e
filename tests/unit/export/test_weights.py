"""stk.export.weights: a full fine-tune's checkpoint made a pipeline with --model's other components, on copies of
the session's real run (`trained`: the tiny SD, 2 ranks): --model of another family, and ZeRO shards that DeepSpeed
cannot read in a checkpoint saved without digests (so not verified first), are refused, and nothing is left."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.checkpoints import OPTIM, run_model, step_dir, without_digests

from stk.errors import CheckpointDamaged, InputError
from stk.export import ExportOptions, Format, export


def test_model_of_another_family_is_refused_before_the_weights_are_read(
    trained: tuple[list[Any], Path], sdxl: Path, tmp_path: Path
) -> None:
    _, out = trained
    opts = ExportOptions(str(step_dir(out, 4)), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, model=str(sdxl))
    with pytest.raises(
        InputError, match=f"--model {sdxl}: SDXL's pipeline, but .* trained SD's unet; give the --model"
    ):
        export(opts)
    assert not list(tmp_path.iterdir())


def test_unreadable_shards_of_a_checkpoint_without_digests_are_exit_6(
    copied: tuple[list[Any], Path], tmp_path: Path
) -> None:
    args, out = copied
    checkpoint = step_dir(out, 4)
    without_digests(checkpoint)
    os.truncate(checkpoint / OPTIM.format(0), 1000)
    model = run_model(args)
    with pytest.raises(CheckpointDamaged, match=f"{checkpoint}: DeepSpeed cannot read it .*; is the checkpoint whole"):
        export(ExportOptions(str(checkpoint), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, model=model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
