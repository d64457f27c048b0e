"""Image files for the tests of stk.images.info: written in each format, with an EXIF orientation, and read back as
headers or error kinds."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from stk.datagen import FORMATS, make_image, save
from stk.images.info import ImageHeader, read_header


def read_header_bytes(data: bytes, max_pixels: int | None = None) -> ImageHeader:
    return read_header(io.BytesIO(data), len(data), max_pixels)


def probe_file(path: Path, max_pixels: int | None = None) -> ImageHeader:
    with open(path, "rb") as f:
        return read_header(f, os.path.getsize(path), max_pixels)


def write(tmp_path: Path, fmt: str, width: int, height: int, name: str = "img", **kwargs: Any) -> Path:
    path = tmp_path / f"{name}{FORMATS[fmt]}"
    save(make_image(width, height, seed=width + height), str(path), fmt, **kwargs)
    return path
