"""stk.train.report.metrics: metrics.jsonl truncated to the resumed step."""

from __future__ import annotations

import json
from pathlib import Path

from stk.train.report.metrics import MetricsLog


def test_metrics_rows_past_the_resumed_step_are_dropped(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)
    log.start(0)
    for step in range(1, 8):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    with open(log.path, "a") as f:
        f.write('{"step": 8, "lo')  # torn by a kill
    log.start(5)
    log.write({"step": 6, "loss": 0.5})
    log.close()
    steps = [json.loads(line)["step"] for line in Path(log.path).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    MetricsLog(str(tmp_path / "other"), enabled=False).start(0)  # rank != 0: writes nothing
    assert not (tmp_path / "other").exists()
