"""Files stk writes honour the umask, as `open()` does: on shared storage another user reads the scan, the cache and
the exports. mkstemp (atomic writes) and safetensors make 0600 files; the scan's metadata.parquet and errors.jsonl
and stk-export's file were 0600, and another user's stk-cache could not read the scan. Checked with a second user
(nobody, through subprocess's `user=`), which needs root."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from support.commands import clean_env

from stk.cli.scan import main as scan_main
from stk.datagen import generate_dataset
from stk.export import ExportOptions, Format, export
from stk.export.adapters import METADATA
from stk.models import Family
from stk.storage.modes import honour_umask, umask
from stk.train.trainable.lora import LORA_WEIGHTS

pytestmark = [
    pytest.mark.usefixtures("keep_logging"),
    pytest.mark.skipif(os.geteuid() != 0, reason="reading as a second user needs root (subprocess user=)"),
]

OTHER_USER = 65534  # nobody


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user may enter (pytest's tmp_path is 0700), written under umask 022."""
    folder = Path(tempfile.mkdtemp(prefix="stk-shared-"))
    folder.chmod(0o755)
    saved = os.umask(0o022)
    yield folder
    os.umask(saved)
    shutil.rmtree(folder)


def _read_by_another_user(files: list[Path]) -> None:
    proc = subprocess.run(["cat", *map(str, files)], user=OTHER_USER, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_the_umask_is_read_without_being_set(shared: Path) -> None:
    assert umask() == 0o022
    assert os.umask(0o022) == 0o022  # still the test's


def test_a_scan_is_0644_and_read_by_another_user(shared: Path) -> None:
    generate_dataset(str(shared / "images"), 6, seed=3)
    (shared / "images" / "broken.png").write_bytes(b"not a png")  # a row in errors.jsonl
    result = CliRunner().invoke(
        scan_main,
        [str(shared / "images"), "--out", str(shared / "scan"), "-q", "--max-errors", "5"],
        env=clean_env(),
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    modes = _modes(shared / "scan")
    assert {"metadata.parquet", "errors.jsonl", "buckets.json", "summary.json"} <= set(modes)
    assert modes == dict.fromkeys(modes, 0o644)
    _read_by_another_user([shared / "scan" / name for name in modes])


def test_an_export_is_0644_and_read_by_another_user(shared: Path) -> None:
    """The kohya file is safetensors' own (0600), where the diffusers one is a copy."""
    final = shared / "final"
    final.mkdir()
    layer = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    tensors = {f"{layer}.lora_A.weight": torch.zeros(4, 8), f"{layer}.lora_B.weight": torch.zeros(8, 4)}
    save_file(tensors, final / LORA_WEIGHTS, metadata={METADATA: json.dumps({"r": 4, "lora_alpha": 4})})
    out = shared / "lora.safetensors"
    export(ExportOptions(str(final), str(out), Format.KOHYA, Family.SD))
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    _read_by_another_user([out])


def test_a_folder_of_0600_files_takes_the_umask(shared: Path) -> None:
    """What safetensors leaves in stk-train's final/: every file under the folder is given the umask's mode."""
    (shared / "model" / "unet").mkdir(parents=True)
    for name in ("model_index.json", "unet/weights.safetensors"):
        (shared / "model" / name).write_bytes(b"x")
        (shared / "model" / name).chmod(0o600)
    os.umask(0o027)
    honour_umask(shared / "model")
    assert _modes(shared / "model") == {"model_index.json": 0o640, "unet/weights.safetensors": 0o640}
