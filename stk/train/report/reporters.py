"""Where rank 0 reports each step's numbers and the validation images besides metrics.jsonl: TensorBoard (the default)
or Weights & Biases (`pip install 'stk[wandb]'`; `WANDB_MODE=offline` writes the run to OUTPUT/wandb/ for a later
`wandb sync`), or nowhere.

Both continue the same log when a run resumes: TensorBoard purges the events from the first step trained again
(SummaryWriter's purge_step), so each step shows once; W&B resumes the run whose id OUTPUT/wandb/stk-run-id
keeps, and keeps the first value it was given for a step (a run killed after its last checkpoint logged the steps
it trains again, with the same values: training is deterministic).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Protocol

from stk.errors import InputError
from stk.storage.failures import storage_errors

__all__ = ["REPORTERS", "TENSORBOARD_DIR", "WANDB_DIR", "Reporter", "check_reporter", "open_reporter"]

REPORTERS = ("tensorboard", "wandb", "none")
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
_RUN_ID = "stk-run-id"


class Reporter(Protocol):
    def scalars(self, values: dict[str, float], step: int, walltime: float | None) -> None: ...

    def images(self, images: dict[str, Any], step: int) -> None:
        """tag -> HxWx3 uint8 array."""

    def close(self) -> None: ...


def check_reporter(name: str) -> None:
    """Refuse a reporter that cannot work here, before any model loads."""
    if name not in REPORTERS:
        raise InputError(f"--report-to {name}: choose one of {', '.join(REPORTERS)}")
    if name == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise InputError(
                "--report-to wandb: wandb is not installed (pip install 'stk[wandb]'), or use tensorboard"
            ) from None


def open_reporter(name: str, output_dir: str, resumed_step: int) -> Reporter | None:
    """The reporter `name` (checked by `check_reporter` first), or None for none."""
    if name == "tensorboard":
        return _TensorBoard(os.path.join(output_dir, TENSORBOARD_DIR), resumed_step)
    if name == "wandb":
        return _Wandb(output_dir)
    return None


class _TensorBoard:
    def __init__(self, directory: str, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        with storage_errors(directory):
            self._writer = SummaryWriter(directory, purge_step=resumed_step + 1)

    def scalars(self, values: dict[str, float], step: int, walltime: float | None) -> None:
        with storage_errors(self.directory):
            for name, value in values.items():
                self._writer.add_scalar(name, value, step, walltime=walltime)
            self._writer.flush()

    def images(self, images: dict[str, Any], step: int) -> None:
        with storage_errors(self.directory):
            for tag, array in images.items():
                self._writer.add_image(tag, array, step, dataformats="HWC")
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, output_dir: str) -> None:
        import wandb

        self._wandb = wandb
        folder = os.path.join(output_dir, WANDB_DIR)
        id_file = os.path.join(folder, _RUN_ID)
        with storage_errors(folder):
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(id_file):
                with open(id_file, encoding="utf-8") as f:
                    run_id = f.read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]
                with open(id_file, "w", encoding="utf-8") as f:
                    f.write(run_id + "\n")
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "stk"),
                dir=output_dir,
                id=run_id,
                resume="allow",
                name=os.path.basename(os.path.abspath(output_dir)),
                settings=wandb.Settings(silent=True),
            )
        except Exception as exc:
            raise InputError(
                f"--report-to wandb: {str(exc).splitlines()[0]} (wandb login, or WANDB_MODE=offline to sync later)"
            ) from None

    def scalars(self, values: dict[str, float], step: int, walltime: float | None) -> None:
        self._run.log(values, step=step)

    def images(self, images: dict[str, Any], step: int) -> None:
        self._run.log({tag: self._wandb.Image(array) for tag, array in images.items()}, step=step)

    def close(self) -> None:
        self._run.finish()
