"""stk.export.weights: a full fine-tune's checkpoint made a pipeline with --model's other components, on copies of
the session's real run (`trained`: the tiny SD, 2 ranks): --model of another family, and ZeRO shards that DeepSpeed
cannot read in a checkpoint saved without digests (so not verified first), are one line each, and nothing is left."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.checkpoints import OPTIM, step_dir
from support.commands import one_error, stk_export

from stk.errors import CheckpointDamaged, ExitCode
from stk.export import ExportOptions, Format, export
from stk.train.checkpoint import SETTINGS


def test_model_of_another_family_is_one_line_exit_3(copied: tuple[list[Any], Path], sdxl: Path, tmp_path: Path) -> None:
    _, out = copied
    file = tmp_path / "m.safetensors"
    proc = stk_export(step_dir(out, 4), file, "--format", "single-file", "--model", sdxl)
    one_error(proc, ExitCode.INPUT, f"--model {sdxl}: SDXL's pipeline, but", "trained SD's unet; give the --model the")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_unreadable_shards_of_a_checkpoint_without_digests_are_exit_6(
    copied: tuple[list[Any], Path], tmp_path: Path
) -> None:
    args, out = copied
    checkpoint = step_dir(out, 4)
    record = checkpoint / SETTINGS
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    os.truncate(checkpoint / OPTIM.format(0), 1000)
    model = str(args[args.index("--model") + 1])
    with pytest.raises(CheckpointDamaged, match=f"{checkpoint}: DeepSpeed cannot read it .*; is the checkpoint whole"):
        export(ExportOptions(str(checkpoint), str(tmp_path / "m.safetensors"), Format.SINGLE_FILE, model=model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
