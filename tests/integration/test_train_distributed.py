"""The torch.distributed rendezvous under mpiexec: two real ranks that meet through DeepSpeed at the address rank 0
broadcast (not `hostname -I`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.commands import EXTENSIONS_DIR

from stk.cluster.slurm import free_port
from stk.errors import InfraError
from stk.train.deepspeed import distributed

MPIEXEC = Path(sys.executable).parent / "mpiexec"


RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from stk.train.deepspeed.distributed import init_distributed, resolve_dist_env
    from stk.cluster.world import get_world

    world = get_world()
    env = resolve_dist_env(world, os.environ)
    init_distributed(env, backend="gloo")
    total = torch.tensor([float(env.rank)])
    torch.distributed.all_reduce(total)
    result = {
        "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
        "resolved": env.master_addr, "MASTER_ADDR": os.environ["MASTER_ADDR"],
        "MASTER_PORT": os.environ["MASTER_PORT"], "port": env.master_port, "sum": total.item(),
    }
    with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    """
)


def _rank_env() -> dict[str, str]:
    """No Slurm, MPI or launcher variables from the outside, DeepSpeed on CPU, the session's op builds."""
    dropped = ("STK_", "SLURM_", "PMI_", "PMIX_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    for name in (*distributed.LAUNCHER_VARS, "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS"):
        env.pop(name, None)
    EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR), PYTHONUNBUFFERED="1")
    return env


needs_build = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler: DeepSpeed's shared-memory op cannot build"
)


@pytest.mark.integration
@needs_build
def test_two_mpi_ranks_meet_at_rank_0s_address(tmp_path: Path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=_rank_env(),
        timeout=400,  # the first run builds DeepSpeed's shared-memory op
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"ranks failed after {elapsed:.0f} s:\n{proc.stderr[-4000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["local_rank"] == r["rank"] for r in results)
    assert all(r["sum"] == 1.0 for r in results)  # 0 + 1
    broadcast = results[0]["resolved"]
    assert broadcast == socket.gethostbyname(socket.gethostname())  # rank 0's host name, not `hostname -I`
    assert all(r["MASTER_ADDR"] == r["resolved"] == broadcast for r in results)
    assert all(r["MASTER_PORT"] == str(r["port"]) == str(results[0]["port"]) for r in results)


TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import datetime, sys
    from stk.errors import InfraError
    from stk.train.deepspeed.distributed import DistEnv, init_distributed

    try:  # rank 0 of 2, and rank 1 never comes
        init_distributed(DistEnv(0, 2, 0, 2, "127.0.0.1", int(sys.argv[1]), "n"), "gloo", datetime.timedelta(seconds=2))
    except InfraError as exc:
        print(exc)
        sys.exit(exc.exit_code)
    """
)


@pytest.mark.integration
@needs_build
def test_real_rendezvous_timeout_is_an_infra_error(tmp_path: Path):
    script = tmp_path / "alone.py"
    script.write_text(TIMEOUT_SCRIPT)
    port = free_port()
    proc = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, env=_rank_env(), timeout=400
    )
    assert proc.returncode == InfraError.exit_code, proc.stderr[-4000:]
    assert f"rendezvous at 127.0.0.1:{port} did not complete" in proc.stdout
