"""What a run reports per optimizer step, written by rank 0: OUTPUT/metrics.jsonl (one JSON line per
step, flushed at once, so `tail -f metrics.jsonl | jq` follows a run and a killed run loses nothing it
reported) and the same numbers, with the validation images, to a reporter (stk.train.report.reporters: TensorBoard by
default). A round of validation images at step 0 (before training) is a row of its own.

A resumed run trains again the steps after its checkpoint: their rows are dropped from metrics.jsonl, so it
holds each step once.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import torch

from stk.storage.failures import storage_errors
from stk.train.report.reporters import Reporter, check_reporter, open_reporter

__all__ = ["MetricsLog", "peak_gpu_memory"]

# metrics.jsonl fields that are not curves (the step is the x axis)
_NOT_SCALARS = frozenset({"step", "epoch", "time"})


class MetricsLog:
    def __init__(self, output_dir: str, enabled: bool, report_to: str = "tensorboard") -> None:
        check_reporter(report_to)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file: IO[str] | None = None
        self._reporter: Reporter | None = None
        self.enabled = enabled
        self.report_to = report_to

    def start(self, resumed_step: int) -> None:
        """Open for appending; rows past the step a run resumes from are dropped, since those steps
        are trained again (a run killed after its last checkpoint)."""
        if not self.enabled:
            return
        with storage_errors(self.path):
            self._start(resumed_step)
        self._reporter = open_reporter(self.report_to, self.output_dir, resumed_step)

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
        if self._reporter is not None:
            values = {
                f"train/{name}": value
                for name, value in row.items()
                if name not in _NOT_SCALARS and isinstance(value, (int, float))
            }
            if row.get("dataset") and isinstance(row.get("loss"), (int, float)):  # a curve per dataset
                values[f"train/loss/{row['dataset']}"] = row["loss"]
            self._reporter.scalars(values, row["step"], row.get("time"))

    def images(self, step: int, images: dict[str, Any]) -> None:
        """Validation images (tag -> HxWx3 uint8 array) at `step`, to the reporter."""
        if self._reporter is not None:
            self._reporter.images(images, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._reporter is not None:
            self._reporter.close()
            self._reporter = None


def peak_gpu_memory(device: torch.device) -> int | None:
    """Bytes: the most this rank's GPU has held in tensors so far (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn last line from a kill: dropped
