"""stk.cluster.world under real MPI ranks: one rank's failure reaches every rank."""

from __future__ import annotations

import pytest

RANK_ONE_FAILS = """
import sys

from stk.errors import InputError
from stk.shards.manifest import ManifestDamaged
from stk.cluster.world import get_world

world = get_world()
FAILURES = [InputError("rank 1 cannot load the model"), ManifestDamaged("cache/manifest.json", "not JSON")]

def load(failure):
    if world.rank == 1:
        raise failure
    return world.rank

seen = []
for failure in FAILURES:
    try:
        world.run_everywhere(lambda: load(failure))
    except type(failure) as exc:
        seen.append(str(exc))
with open(f"{sys.argv[1]}/rank{world.rank}.txt", "w") as f:
    f.write("\\n".join(seen))
"""


@pytest.mark.integration
def test_one_ranks_failure_reaches_every_rank_under_mpi(tmp_path) -> None:
    """An error whose __init__ takes other arguments than its message (ManifestDamaged) arrives whole too."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "fail.py"
    script.write_text(RANK_ONE_FAILS)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines[0] == "rank 1 cannot load the model"
        assert lines[1].startswith("cache/manifest.json is damaged (not JSON): run `stk-cache verify cache --repair`")
