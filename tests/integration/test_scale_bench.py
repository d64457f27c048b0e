"""bench/scale.py at a tiny size, its table stage only (stk-scan and the read + stat floor): the lines it reads
from stk-scan (the listing line, the summary line and its JSON) are still there, rank 0's peak RSS is read, and the
report judges the targets. Its numbers mean nothing at this size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.commands import REPO, scan_env

pytestmark = pytest.mark.integration


def test_scale_bench_reports_the_table_stage(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(REPO / "bench" / "scale.py"),
        "--sizes",
        "100,200",
        "--ranks",
        "1",
        "--only",
        "table",
        "--data",
        str(tmp_path),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for size in ("100", "200"):
        # wall, work, floor and listing seconds, then rank 0's peak in MB
        row = re.search(rf"^table\s+{size}\s+1\s+(?:-?[\d.]+\s+){{4}}r0 ([\d,]+)\s", out, re.M)
        assert row, f"no table row at {size}:\n{out}"
        assert int(row.group(1).replace(",", "")) > 50, f"at {size}: a peak RSS below 50 MB is not read"
    assert re.search(r"table scan / read\+stat floor at\s+200: .* (PASS|FAIL)", out), out
    assert re.search(r"table scan rank-0 peak RSS at 1,000,000 \(extrapolated from 200\): .* (PASS|FAIL)", out), out
    growth = r"table  bytes per image, worst rank: .* (PASS|FAIL);  growth 100 -> 200: .* (PASS|FAIL)"
    assert re.search(growth, out), out
