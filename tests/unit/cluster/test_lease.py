"""stk.cluster.lease: one run per output directory, driven with holders that stand for other processes and hosts."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from support.commands import LEASE_NAME

from stk.cluster.lease import STALE_SECONDS, Holder, Lease
from stk.errors import InputError, PreflightFailed


def other(host: str = "elsewhere", pid: int = 4242, job: str | None = None, restart: int = 0) -> Holder:
    return Holder(host, pid, f"run-{host}-{pid}", job, restart)


def write_lease(output: Path, holder: Holder, age: float = 0.0) -> Path:
    path = output / LEASE_NAME
    path.write_text(json.dumps(asdict(holder)))
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_acquire_writes_who_holds_it_and_release_removes_it(tmp_path):
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    held = json.loads((tmp_path / LEASE_NAME).read_text())
    assert held["pid"] == os.getpid() and held["host"] == lease.holder.host and held["run"] == lease.holder.run
    lease.release()
    assert not (tmp_path / LEASE_NAME).exists()
    assert os.listdir(tmp_path) == []  # no temp files left behind


def test_a_directory_that_is_a_file_is_refused_and_kept(tmp_path):
    (tmp_path / "out").write_text("mine")
    with pytest.raises(InputError, match=r"--out .*/out: is a file, not a directory"):
        Lease(str(tmp_path / "out"), "stk-scan", "--out").acquire()
    assert (tmp_path / "out").read_text() == "mine"


def test_a_live_holder_elsewhere_is_refused_with_its_host_pid_and_job(tmp_path):
    path = write_lease(tmp_path, other(job="1234"))
    with pytest.raises(PreflightFailed, match=r"another stk-train run \(host elsewhere, pid 4242, Slurm job 1234"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()
    assert json.loads(path.read_text())["run"] == "run-elsewhere-4242"  # untouched


def test_a_live_process_on_this_host_is_refused(tmp_path):
    mine = Holder.this_process()
    write_lease(tmp_path, replace(other(host=mine.host, pid=os.getppid())))
    with pytest.raises(PreflightFailed, match="in use"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()


def test_a_dead_process_on_this_host_loses_its_lease(tmp_path):
    mine = Holder.this_process()
    write_lease(tmp_path, other(host=mine.host, pid=dead_pid()))
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == lease.holder.run
    assert sorted(os.listdir(tmp_path)) == [LEASE_NAME]


def test_a_zombie_on_this_host_loses_its_lease(tmp_path):
    """A rank killed by its job's MPI abort can stay a zombie until reaped: it answers signal 0 but holds nothing."""
    mine = Holder.this_process()
    zombie = subprocess.Popen(["true"])
    try:
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        os.kill(zombie.pid, 0)  # still there for signal 0
        write_lease(tmp_path, other(host=mine.host, pid=zombie.pid))
        lease = Lease(str(tmp_path), "stk-train", "--output-dir")
        lease.acquire()
        assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == lease.holder.run
    finally:
        zombie.wait()


def test_a_lease_not_renewed_for_the_stale_time_is_taken_over(tmp_path):
    write_lease(tmp_path, other(), age=STALE_SECONDS + 5)
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == lease.holder.run


def test_an_earlier_attempt_of_the_same_requeued_slurm_job_is_taken_over(tmp_path):
    write_lease(tmp_path, other(job="77", restart=0))
    me = replace(Holder.this_process(), job_id="77", restart=1)
    Lease(str(tmp_path), "stk-train", "--output-dir", me).acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == me.run
    # the same attempt (another step of the same allocation) is a live run: refused
    write_lease(tmp_path, other(job="78", restart=1))
    with pytest.raises(PreflightFailed):
        Lease(str(tmp_path), "stk-train", "--output-dir", replace(me, job_id="78")).acquire()


def test_a_torn_lease_is_judged_by_its_age(tmp_path):
    (tmp_path / LEASE_NAME).write_text("{not json")
    with pytest.raises(PreflightFailed, match=r"host \?"):
        Lease(str(tmp_path), "stk-train", "--output-dir").acquire()
    then = time.time() - STALE_SECONDS - 5
    os.utime(tmp_path / LEASE_NAME, (then, then))
    Lease(str(tmp_path), "stk-train", "--output-dir").acquire()


def test_release_leaves_a_successors_lease_alone(tmp_path):
    lease = Lease(str(tmp_path), "stk-train", "--output-dir")
    lease.acquire()
    write_lease(tmp_path, other())  # taken over while this run was frozen
    lease.release()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["run"] == "run-elsewhere-4242"
