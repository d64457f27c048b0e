"""Inputs that fail: a prefix that makes root obey permissions, an image no decoder implements, a raising stand-in,
safetensors files damaged as a disk or a copy damages them."""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def without_dac_override() -> tuple[str, ...]:
    """A prefix that makes permission checks apply: for root, setpriv dropping CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (root still owns its files, but a 0555 directory is not writable and a 0000 one
    cannot be listed); nothing otherwise."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root bypasses permissions and setpriv (util-linux) is missing to drop that")
    caps = "-dac_override,-dac_read_search"
    return (setpriv, "--bounding-set", caps, "--inh-caps", caps)


def unimplemented_dds() -> bytes:
    """A 4x4 DDS of DXGI format 93, which Pillow 13's DDS plugin does not implement: `Image.open` raises
    NotImplementedError, as on some real DDS files (a plugin may raise anything, not only Pillow's usual kinds)."""
    pixel_format = struct.pack("<II4s5I", 32, 0x4, b"DX10", 0, 0, 0, 0, 0)  # DDPF_FOURCC, then a DX10 header
    header = struct.pack("<7I44x", 124, 0x1007, 4, 4, 0, 0, 0) + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0)
    return b"DDS " + header + struct.pack("<5I", 93, 3, 0, 1, 0) + bytes(64)


def raising(exc: BaseException) -> Callable[..., Any]:
    """A stand-in for a function (a decoder's `open_image`) that raises `exc` whatever it is given."""

    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return raise_it


def _overwrite_header(file: Path) -> None:
    with open(file, "r+b") as f:
        f.seek(8)  # past the header's length: its JSON
        f.write(b"\0" * 64)


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


# (damage done to a .safetensors file in place, what safetensors then says), as pytest.param with an id
DAMAGED_SAFETENSORS = [
    pytest.param(_truncate, "file not fully covered", id="truncated"),
    pytest.param(_overwrite_header, "invalid JSON in header", id="header-overwritten"),
]
