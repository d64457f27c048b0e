"""stk.world under real MPI ranks: one rank's failure reaches every rank."""

from __future__ import annotations

import pytest

RANK_ONE_FAILS = """
import sys

from stk.errors import InputError
from stk.world import get_world

world = get_world()

def load():
    if world.rank == 1:
        raise InputError("rank 1 cannot load the model")
    return world.rank

try:
    world.run_everywhere(load)
except InputError as exc:
    with open(f"{sys.argv[1]}/rank{world.rank}.txt", "w") as f:
        f.write(str(exc))
"""


@pytest.mark.integration
def test_one_ranks_failure_reaches_every_rank_under_mpi(tmp_path) -> None:
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
        assert (tmp_path / f"rank{rank}.txt").read_text() == "rank 1 cannot load the model"
