"""stk.storage.listing: a tree or an S3 prefix listed in parts by ranks and threads gives exactly the
sequential listing, sorted; an S3 outage in the middle of it is ridden through, or past the budget is
one line of exit 69."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest
from support.commands import MPIEXEC
from support.weed_server import S3_ENV, WeedServer, s3_client

from stk import storage
from stk.cluster.world import World
from stk.errors import ExitCode, InfraError
from stk.storage import listing
from stk.storage.listing import file_infos, list_sorted

FLAT = 1100  # more names than one page: the level is cut by the first characters of its names


def _sequential(root: str) -> list[storage.FileInfo]:
    return sorted(storage.list_files(root), key=lambda info: info.key)


def test_a_local_tree_in_parts_is_the_sequential_listing(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for top in ("a", "b", "c.d", "日本", "é"):
        for sub in ("x", "y", "z"):
            (root / top / sub).mkdir(parents=True)
            for name in ("1.jpg", "1.txt", "ü.png"):
                (root / top / sub / name).write_bytes(b"x")
    (root / "empty").mkdir()
    (root / "top.jpg").write_bytes(b"t")
    (root / "a.jpg").write_bytes(b"a")
    found = list(file_infos(list_sorted(str(root), World(), threads=3)))
    assert len(found) == 5 * 3 * 3 + 2
    assert found == _sequential(str(root))


def _files(*keys: str) -> pa.Table:
    return listing._table([storage.FileInfo(key, f"/r/{key}", i, 0.0) for i, key in enumerate(keys)], "/r")


def test_a_location_is_held_only_where_it_is_not_the_root_joined_with_the_key() -> None:
    infos = [
        storage.FileInfo("a.jpg", "/r/a.jpg", 1, 0.0),
        storage.FileInfo("b/", "/r/b", 0, 0.0, error="cannot list directory: denied", error_kind="unreadable"),
        storage.FileInfo("c.jpg", "/elsewhere/c.jpg", 2, 0.0),
    ]
    table = listing._table(infos, "/r/").replace_schema_metadata({listing._ROOT: "/r/"})
    assert table.column("location").to_pylist() == [None, b"/r/b", b"/elsewhere/c.jpg"]
    assert list(file_infos(table)) == infos


def test_parts_are_put_in_key_order_and_overlapping_ones_sorted_whole() -> None:
    top = listing._by_key(_files("c.jpg", "a.jpg", "z.jpg"))
    ranks = [[_files("d/1", "d/2"), _files("b/2", "b/1")], [_files("e/1")]]  # each rank's parts, a chunk each
    disjoint = listing._merged(top, [pa.concat_tables([listing._by_key(p) for p in parts]) for parts in ranks])
    assert disjoint.column("key").to_pylist() == [b"a.jpg", b"b/1", b"b/2", b"c.jpg", b"d/1", b"d/2", b"e/1", b"z.jpg"]
    assert disjoint.column("size").to_pylist() == [1, 1, 0, 0, 0, 1, 0, 2]
    overlapping = listing._merged(top, [_files("b", "y"), _files("c", "d")])
    assert overlapping.column("key").to_pylist() == [b"a.jpg", b"b", b"c", b"c.jpg", b"d", b"y", b"z.jpg"]


# --- S3 ---------------------------------------------------------------------------------------------


def _put(endpoint: str, bucket: str, keys: list[str]) -> None:
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=b""), keys))


@pytest.fixture(scope="module")
def buckets(s3_server: str) -> str:
    """Bucket "tree": nested prefixes (names that S3 and SeaweedFS order differently: "a.jpg" and
    "a/"), unicode, a flat prefix of more than a page, a folder marker; bucket "flat": keys with no "/"."""
    nested = [f"nested/{top}/{sub}/{i}.jpg" for top in ("a", "b", "日本") for sub in ("x", "y") for i in range(3)]
    nested += ["nested/a.jpg", "nested/a-b.txt", "nested/é.png", "nested/marker/"]
    flat = [f"flat/img_{i:05d}.jpg" for i in range(FLAT)] + ["flat/a.jpg", "flat/a/x.jpg", "flat/日本/ü.jpg"]
    _put(s3_server, "tree", nested + flat)
    _put(s3_server, "flat", [f"k{i:05d}" for i in range(FLAT)] + ["z", "ü"])
    return s3_server


@pytest.fixture
def on_s3(buckets: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    storage.configure_s3(buckets)
    yield
    storage.configure_s3(None)


@pytest.mark.integration
@pytest.mark.parametrize("root", ["s3://tree/nested", "s3://tree/flat", "s3://flat", "s3://tree/none", "s3://tree"])
def test_an_s3_prefix_in_parts_is_the_sequential_listing(on_s3: None, root: str) -> None:
    found = list(file_infos(list_sorted(root, World(), threads=4)))
    assert found == _sequential(root)
    expected = {"s3://tree/nested": 21, "s3://tree/flat": FLAT + 3, "s3://flat": FLAT + 2, "s3://tree/none": 0}
    assert len(found) == expected.get(root, 21 + FLAT + 3)


_RANKS = """
import json, sys
from stk import storage
from stk.storage.listing import file_infos, list_sorted
from stk.cluster.world import get_world
storage.configure_s3(sys.argv[1])
world = get_world()
found = list_sorted(sys.argv[2], world, threads=2)
if world.rank == 0:
    print(json.dumps([info.key for info in file_infos(found)]))
"""


@pytest.mark.integration
def test_two_ranks_list_a_flat_bucket_as_one_lister_does(on_s3: None, buckets: str) -> None:
    command = [str(MPIEXEC), "-n", "2", sys.executable, "-c", _RANKS, buckets, "s3://flat"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **S3_ENV}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [info.key for info in _sequential("s3://flat")]


@pytest.mark.integration
def test_an_outage_in_the_middle_is_ridden_through_or_past_the_budget_is_one_line_of_69(
    weed: WeedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server is killed once the parts are planned, as the first part starts."""
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    _put(weed.endpoint, "flat", [f"k{i:05d}" for i in range(FLAT)])
    storage.configure_s3(weed.endpoint, retry_seconds=30)
    expected = _sequential("s3://flat")
    part_list = listing._S3Parts.list
    outage: dict[str, float] = {}  # the next part to start kills the server, back after this many seconds (inf: never)
    restarts: list[threading.Timer] = []

    def kill_first(parts: listing._S3Parts, part: str) -> list[storage.FileInfo]:
        back_after = outage.pop("back_after", 0.0)  # one thread takes it
        if back_after:
            weed.kill()
            if back_after < math.inf:
                restarts.append(threading.Timer(back_after, weed.start))
                restarts[-1].start()
        return part_list(parts, part)

    monkeypatch.setattr(listing._S3Parts, "list", kill_first)
    try:
        storage.configure_s3(weed.endpoint, retry_seconds=2)
        outage["back_after"] = math.inf
        with pytest.raises(InfraError) as failed:
            list_sorted("s3://flat", World(), threads=4)
        message = str(failed.value)
        assert "\n" not in message and f"{weed.endpoint} did not answer for 2 s" in message, message
        assert failed.value.exit_code == ExitCode.INFRA == 69

        weed.start()
        storage.configure_s3(weed.endpoint, retry_seconds=60)
        outage["back_after"] = 4
        assert list(file_infos(list_sorted("s3://flat", World(), threads=4))) == expected
        assert len(restarts) == 1
    finally:
        for restart in restarts:
            restart.join()  # its server is up
        storage.configure_s3(None)
