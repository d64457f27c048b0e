"""OUTPUT/metrics.jsonl: one JSON line per optimizer step, written by rank 0 and flushed at once,
so `tail -f metrics.jsonl | jq` follows a run and a killed run loses nothing it reported."""

from __future__ import annotations

import json
import os
from typing import IO, Any

from stk.storage.failures import storage_errors

__all__ = ["MetricsLog"]


class MetricsLog:
    def __init__(self, output_dir: str, enabled: bool) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file: IO[str] | None = None
        self.enabled = enabled

    def start(self, resumed_step: int) -> None:
        """Open for appending; rows past the step a run resumes from are dropped, since those steps
        are trained again (a run killed after its last checkpoint)."""
        if not self.enabled:
            return
        with storage_errors(self.path):
            self._start(resumed_step)

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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn last line from a kill: dropped
