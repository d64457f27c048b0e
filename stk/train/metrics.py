"""What a run reports per optimizer step, written by rank 0: OUTPUT/metrics.jsonl (one JSON line per
step, flushed at once, so `tail -f metrics.jsonl | jq` follows a run and a killed run loses nothing it
reported) and, with `--report-to tensorboard` (the default), the same numbers as TensorBoard scalars in
OUTPUT/tensorboard/.

A resumed run trains again the steps after its checkpoint: their rows are dropped from metrics.jsonl, and
TensorBoard is told to purge its events from that step on (SummaryWriter's purge_step), so both hold each
step once.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from stk.storage.failures import storage_errors

__all__ = ["REPORTERS", "TENSORBOARD_DIR", "MetricsLog"]

REPORTERS = ("tensorboard", "none")
TENSORBOARD_DIR = "tensorboard"
# metrics.jsonl fields that are not curves (the step is the x axis)
_NOT_SCALARS = frozenset({"step", "epoch", "time"})


class MetricsLog:
    def __init__(self, output_dir: str, enabled: bool, report_to: str = "tensorboard") -> None:
        if report_to not in REPORTERS:
            raise ValueError(f"report_to {report_to!r}: choose one of {REPORTERS}")
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.tensorboard_dir = os.path.join(output_dir, TENSORBOARD_DIR)
        self._file: IO[str] | None = None
        self._board: Any = None  # torch.utils.tensorboard.SummaryWriter
        self.enabled = enabled
        self.report_to = report_to

    def start(self, resumed_step: int) -> None:
        """Open for appending; rows past the step a run resumes from are dropped, since those steps
        are trained again (a run killed after its last checkpoint)."""
        if not self.enabled:
            return
        with storage_errors(self.path):
            self._start(resumed_step)
        if self.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            with storage_errors(self.tensorboard_dir):
                self._board = SummaryWriter(self.tensorboard_dir, purge_step=resumed_step + 1)

    def _start(self, resumed_step: int) -> None:
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                rows = [line for line in f if line.strip() and _step(line) <= resumed_step]
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(rows)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (open for the run; close() ends it)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            with storage_errors(self.path):
                self._file.write(json.dumps(row) + "\n")
                self._file.flush()
        if self._board is not None:
            with storage_errors(self.tensorboard_dir):
                for name, value in row.items():
                    if name not in _NOT_SCALARS and isinstance(value, (int, float)):
                        self._board.add_scalar(f"train/{name}", value, row["step"], walltime=row.get("time"))
                self._board.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn last line from a kill: dropped
