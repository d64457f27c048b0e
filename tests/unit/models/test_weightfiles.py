"""stk.models.weightfiles: a component's safetensors files, and the digest of its weights read from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stk.errors import InputError
from stk.models.weightfiles import files_digest, weight_files

TENSORS = {"a.weight": torch.randn(64, 48), "b.bias": torch.randn(7), "c.conv": torch.randn(8, 4, 3, 3)}


def saved(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> list[Path]:
    """`tensors` written as transformers names them: one file, or shards with their index."""
    folder.mkdir(parents=True)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(folder / file))
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = weight_files(folder)
    assert files is not None
    return files


def test_a_copy_in_another_dtype_or_sharding_has_the_same_digest(tmp_path: Path) -> None:
    original = files_digest(saved(tmp_path / "one", TENSORS), torch.bfloat16)
    as_bf16 = {n: t.to(torch.bfloat16) for n, t in TENSORS.items()}
    assert files_digest(saved(tmp_path / "bf16", as_bf16), torch.bfloat16) == original
    assert files_digest(saved(tmp_path / "sharded", TENSORS, shards=2), torch.bfloat16) == original
    assert files_digest(saved(tmp_path / "one-again", TENSORS), torch.float32) != original  # another dtype's values


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_changing_any_tensor_changes_the_digest(tmp_path: Path, name: str) -> None:
    original = files_digest(saved(tmp_path / "one", TENSORS), torch.float32)
    tuned = {**TENSORS, name: TENSORS[name] + 0.01}
    assert files_digest(saved(tmp_path / "tuned", tuned), torch.float32) != original


def test_a_damaged_file_is_an_input_error_naming_it(tmp_path: Path) -> None:
    (file,) = saved(tmp_path / "one", TENSORS)
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(InputError, match=f"cannot read {file}"):
        files_digest([file], torch.float32)
