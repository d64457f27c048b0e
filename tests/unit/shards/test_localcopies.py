"""stk.shards.localcopies: one directory of shard copies shared by several processes (the ranks of a
node), under a size limit that forces evictions: no process ever loses a copy it holds, a killed
process leaves no lease behind, and a download that does not match the manifest is never used."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from stk.errors import CacheIncomplete
from stk.shards.localcopies import LocalCopies

FORK = multiprocessing.get_context("fork")
SHARD_BYTES = 64 * 1024


def make_shards(root: Path, count: int) -> list[dict[str, Any]]:
    """`count` files standing for a cache's shards (a local location is fetched like an S3 one),
    with their manifest entries."""
    root.mkdir()
    entries = []
    for i in range(count):
        data = random.Random(i).randbytes(SHARD_BYTES)
        (root / f"r0-{i:05d}.h5").write_bytes(data)
        entries.append(
            {
                "name": f"r0-{i:05d}.h5",
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "location": str(root / f"r0-{i:05d}.h5"),
            }
        )
    return entries


def read_randomly(directory: str, entries: list[dict[str, Any]], limit: int, seconds: float, seed: int, queue) -> None:
    """A rank's reader: ask for a random shard, open it a moment later (as h5py does), read it whole."""
    copies = LocalCopies(directory, limit)
    rng = random.Random(seed)
    reads, errors = 0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(errors) < 5:
        entry = rng.choice(entries)
        try:
            path = copies.get(entry["location"], entry, lambda _: None)
            time.sleep(0.001)
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != entry["sha256"]:
                    errors.append(f"{path}: other bytes than the manifest lists")
            reads += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    copies.close()
    queue.put((reads, errors, copies.evictions))


def test_processes_sharing_a_directory_under_a_small_limit_never_lose_a_copy(tmp_path: Path) -> None:
    entries = make_shards(tmp_path / "cache", 6)
    shared = tmp_path / "copies"
    queue = FORK.SimpleQueue()
    limit = 2 * SHARD_BYTES  # 4 processes want 4 copies at least: evictions all the time
    processes = [
        FORK.Process(target=read_randomly, args=(str(shared), entries, limit, 8.0, seed, queue)) for seed in range(4)
    ]
    started = time.monotonic()
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert time.monotonic() - started < 60, "a process hangs"
    assert [p.exitcode for p in processes] == [0] * 4
    results = [queue.get() for _ in processes]
    errors = [e for _, errs, _ in results for e in errs]
    assert not errors, errors[:5]
    assert all(reads > 20 for reads, _, _ in results), results
    assert sum(evicted for _, _, evicted in results) > 20, "the limit forced no evictions"
    left = os.listdir(shared)
    assert not [n for n in left if n.startswith(".")], f"temp files left: {left}"
    assert sum(os.path.getsize(shared / n) for n in left) <= limit, "nobody holds a copy now: the limit holds"


def hold(directory: str, entry: dict[str, Any], queue) -> None:
    copies = LocalCopies(directory, None)
    queue.put(copies.get(entry["location"], entry, lambda _: None))
    time.sleep(120)


def test_a_killed_process_leaves_no_lease_and_its_copy_can_go(tmp_path: Path) -> None:
    first, second = make_shards(tmp_path / "cache", 2)
    shared = str(tmp_path / "copies")
    queue = FORK.SimpleQueue()
    holder = FORK.Process(target=hold, args=(shared, first, queue))
    holder.start()
    try:
        held = queue.get()
        copies = LocalCopies(shared, SHARD_BYTES)  # room for one copy
        copies.get(second["location"], second, lambda _: None)
        assert os.path.exists(held), "a copy another process holds was deleted"
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        copies.get(second["location"], second, lambda _: None)  # the next look at the limit
        assert not os.path.exists(held), "the lease of a killed process outlived it"
        assert sorted(os.listdir(shared)) == [os.path.basename(copies.path(second))]
        copies.close()
    finally:
        holder.kill()
        holder.join(10)


def parts(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(".part-"))


def wait_for(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_killed_download_leaves_a_part_folder_that_the_next_process_removes(tmp_path: Path) -> None:
    """Shards served through named pipes stop the downloads where the test wants them: one is
    killed half-way, one stays alive. A new process on the directory removes only the dead one's."""
    dead, live = make_shards(tmp_path / "cache", 2)
    sources = {}
    for entry in (dead, live):
        sources[entry["name"]] = Path(entry["location"]).read_bytes()
        os.unlink(entry["location"])
        os.mkfifo(entry["location"])
    shared = str(tmp_path / "copies")
    os.mkdir(shared)
    queue = FORK.SimpleQueue()
    killed = FORK.Process(target=hold, args=(shared, dead, queue))
    alive = FORK.Process(target=hold, args=(shared, live, queue))
    killed.start()
    alive.start()
    try:
        with open(dead["location"], "wb") as dead_pipe, open(live["location"], "wb") as live_pipe:
            # both downloads have opened their sources: their folders are made and locked
            dead_pipe.write(sources[dead["name"]][: SHARD_BYTES // 2])
            wait_for(lambda: len(list(Path(shared).glob(".part-*/*"))) == 2, "both downloads' temp files")
            os.kill(killed.pid, signal.SIGKILL)
            killed.join(10)
            left = parts(shared)
            LocalCopies(shared, None).close()  # a new process opens the directory
            remaining = parts(shared)
            assert len(left) == 2 and len(remaining) == 1, "the killed download's folder stayed, or the live one's went"
            assert alive.is_alive()
            live_pipe.write(sources[live["name"]])
        copy = queue.get()
        assert Path(copy).read_bytes() == sources[live["name"]]
        assert parts(shared) == [], "the live download did not clean up"
    finally:
        for process in (killed, alive):
            if process.pid is not None:
                process.kill()
                process.join(10)


def test_a_download_that_is_not_the_listed_shard_is_never_used(tmp_path: Path) -> None:
    (entry,) = make_shards(tmp_path / "cache", 1)
    data = bytearray(Path(entry["location"]).read_bytes())
    data[len(data) // 2] ^= 0x01
    Path(entry["location"]).write_bytes(bytes(data))
    copies = LocalCopies(str(tmp_path / "copies"), None)
    with pytest.raises(CacheIncomplete) as raised:
        copies.get(entry["location"], entry, lambda _: None)
    message = str(raised.value)
    assert "\n" not in message and entry["location"] in message
    assert "stk-cache verify" in message and "--repair" in message
    assert os.listdir(tmp_path / "copies") == [], "a damaged download was kept"
    # without the hash only the size is checked: the same bytes are taken
    assert LocalCopies(str(tmp_path / "unchecked"), None, check_sha256=False).get(entry["location"], entry, print)
