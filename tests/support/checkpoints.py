"""What a checkpoint holds on disk, for the tests of stk.train.checkpoint.store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stk.cluster.world import World
from stk.train.checkpoint.digests import FILES, SETTINGS
from stk.train.checkpoint.store import CheckpointDir, Resume

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"

MODEL = "mp_rank_00_model_states.pt"


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def record(out: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(out, step) / SETTINGS).read_text())


def resolve(out: Path, resume: str = "auto") -> Resume | None:
    """What a resume takes, in this process (a world of one verifies every file)."""
    return CheckpointDir(str(out), keep=2, rank=0).resolve(resume, World())


def without_digests(checkpoint: Path) -> None:
    """The checkpoint's record as an older stk wrote it: its settings, no `files` to verify it by."""
    path = checkpoint / SETTINGS
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != FILES}))


def run_model(args: list[Any]) -> str:
    """The --model of a run's arguments (the `trained` fixture's): what a full fine-tune's checkpoint exports with."""
    return str(args[args.index("--model") + 1])
