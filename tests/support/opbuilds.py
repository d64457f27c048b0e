"""A DeepSpeed op build held by this process, for the tests of stk.train.deepspeed.opbuilds."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from stk.train.deepspeed.opbuilds import (
    build_lock,
)
from support.commands import EXTENSIONS_DIR

SHM_OP = "deepspeed_shm_comm"  # what init_distributed builds on the CPU

STOPPED_EARLY = "received before the first training step"


def baton(directory: Path, op: str) -> Path:
    (directory / op).mkdir(parents=True, exist_ok=True)
    return directory / op / "lock"


@contextlib.contextmanager
def building(op: str = SHM_OP) -> Iterator[Path]:
    """This process builds `op` into the session's build directory as stk does: the build lock held and torch's
    baton created and held open."""
    with build_lock(str(EXTENSIONS_DIR), 60):
        path = baton(EXTENSIONS_DIR, op)
        fd = os.open(path, os.O_CREAT | os.O_EXCL)
        try:
            yield path
        finally:
            os.close(fd)
            path.unlink()
