"""What stk-scan wrote, read back (metadata.parquet, errors.jsonl, buckets), and the small datasets its end-to-end tests
share."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from stk.datagen import make_image

IS_ROOT = os.geteuid() == 0


def _rows(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "metadata.parquet").to_pylist()


def _errors(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


def _no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "unexpected error" not in proc.stderr, proc.stderr


def _save_png(path: Path, width: int, height: int, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(width, height, seed=seed).save(path, "PNG")


GOOD = [f"good/g{i}.png" for i in range(6)]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Six good images (80x64, each with a caption) and one file of every bad kind that a tree
    scan with --max-pixels 20000 --missing-caption error finds; returns (root, {path: kind})."""
    root = tmp_path / "corpus"
    for i, rel in enumerate(GOOD):
        _save_png(root / rel, 80, 64, seed=i)
        (root / rel).with_suffix(".txt").write_text(f"good image {i}\n")
    bad = root / "bad"
    bad.mkdir()
    expected = {}

    (bad / "empty.jpg").write_bytes(b"")
    expected["bad/empty.jpg"] = "empty"

    buffer = io.BytesIO()
    make_image(128, 128, seed=3).save(buffer, "JPEG", quality=90)  # 16,384 pixels: under --max-pixels
    whole = buffer.getvalue()
    (bad / "half.jpg").write_bytes(whole[: len(whole) // 2])
    expected["bad/half.jpg"] = "truncated"

    (bad / "notes.png").write_text("this is a text file with an image extension\n" * 5)
    expected["bad/notes.png"] = "not_image"

    make_image(32, 32).save(bad / "icon.jpg", "ICO")  # Pillow reads ICO; stk does not train on it
    expected["bad/icon.jpg"] = "unsupported_format"

    _save_png(bad / "huge.png", 300, 300)  # 90,000 pixels > --max-pixels 20000
    (bad / "huge.txt").write_text("huge\n")
    expected["bad/huge.png"] = "too_many_pixels"

    os.symlink("does-not-exist.png", bad / "dangling.png")
    expected["bad/dangling.png"] = "broken_symlink"

    _save_png(bad / "latin1.png", 80, 64)
    (bad / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    expected["bad/latin1.png"] = "caption_unreadable"

    _save_png(bad / "uncaptioned.png", 80, 64)
    expected["bad/uncaptioned.png"] = "caption_missing"

    if not IS_ROOT:  # root reads a mode-000 file anyway
        _save_png(bad / "locked.png", 80, 64)
        (bad / "locked.txt").write_text("locked\n")
        (bad / "locked.png").chmod(0)
        expected["bad/locked.png"] = "unreadable"
    return root, expected


BAD_ARGS = ["--max-pixels", "20000", "--missing-caption", "error", "--gpus", "1"]
