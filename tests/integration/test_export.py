"""stk-export on a real stk-train run (the session's `trained`: a full fine-tune of the tiny SD on 2 ranks in fp32,
with an EMA): its final/ and its last checkpoint as single files that diffusers' `from_single_file` reads back to
the weights of final/ (the EMA's) and of final-no-ema/ (the raw ones, which the checkpoint holds). The LoRA half is at
the end of test_train_lora.py; the formats of every family in tests/unit/export/."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import UNet2DConditionModel
from support.commands import stk_export


@pytest.mark.integration
def test_single_files_of_a_trained_run(trained: tuple[list[Any], Path], tmp_path: Path) -> None:
    args, out = trained
    model = str(args[args.index("--model") + 1])
    last = out / "checkpoints" / "step-00000004"
    for source, extra, same_as in (
        (out / "final", [], out / "final"),
        (last, ["--model", model], out / "final-no-ema"),
    ):
        file = tmp_path / f"{source.name}.safetensors"
        proc = stk_export(source, file, "--format", "single-file", *extra)
        assert proc.returncode == 0, proc.stderr
        configs = shutil.copytree(
            same_as, tmp_path / f"{source.name}-configs", ignore=shutil.ignore_patterns("*.safetensors")
        )
        read = UNet2DConditionModel.from_single_file(str(file), config=str(configs), subfolder="unet")
        own = UNet2DConditionModel.from_pretrained(same_as, subfolder="unet").state_dict()
        assert read.state_dict().keys() == own.keys()
        assert all(torch.equal(value, own[key]) for key, value in read.state_dict().items()), source
