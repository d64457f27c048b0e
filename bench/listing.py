"""Benchmark S3 listing: stk's parallel listing (stk.storage.listing) against one sequential lister.

    mpiexec -n 2 python bench/listing.py s3://BUCKET/PREFIX --endpoint URL [--threads 8] [--make N] [--latency-ms MS]

--make N first fills the prefix with N empty keys img_0000000.jpg ... (a flat prefix: no "/"), with
64 threads of put_object. Then rank 0 lists the prefix with a plain ListObjectsV2 loop (one page of
1,000 keys at a time, the floor any single lister has), and every rank together lists it with
list_sorted (the ranks x --threads). Rank 0 prints both times, the speedup, and whether the two
listings are the same keys in the same order. Credentials come from the environment, as for stk.

--latency-ms adds a wait before each ListObjectsV2 request (both listers): a local server answers a
page in CPU time, where a remote one costs a round trip (~100 ms a page at AWS, as measured in
issue 27's figures); the wait shows how the listing behaves there, without a network.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stk import storage
from stk.cluster.world import World, get_world
from stk.storage import s3
from stk.storage.listing import list_sorted


def _make(url: str, count: int) -> None:
    bucket, prefix = s3.split_url(url)
    client = s3.client()
    if not any(b["Name"] == bucket for b in client.list_buckets().get("Buckets", [])):
        client.create_bucket(Bucket=bucket)
    base = f"{prefix.rstrip('/')}/" if prefix else ""
    started = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        keys = (f"{base}img_{i:07d}.jpg" for i in range(count))
        list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=b""), keys))
    print(f"made {count} keys in {time.monotonic() - started:.1f} s", flush=True)


def _sequential(url: str) -> list[str]:
    """A plain ListObjectsV2 loop, as one lister does it."""
    bucket, prefix = s3.split_url(url)
    base = f"{prefix.rstrip('/')}/" if prefix else ""
    client = s3.client()
    request = {"Bucket": bucket, "Prefix": base}
    keys: list[str] = []
    while True:
        page = client.list_objects_v2(**request)
        keys.extend(obj["Key"][len(base) :] for obj in page.get("Contents", []))
        if not page.get("IsTruncated"):
            return keys
        request["ContinuationToken"] = page["NextContinuationToken"]


def _add_latency(seconds: float) -> None:
    def wait(**_: Any) -> None:
        time.sleep(seconds)

    s3.client().meta.events.register("before-send.s3.ListObjectsV2", wait)


def _barrier(world: World) -> None:
    """A barrier that sleeps while it waits: MPICH's spins, and would take a core from the sequential lister."""
    if world.comm is not None:
        request = world.comm.Ibarrier()
        while not request.Test():
            time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--make", type=int, default=0, help="first put this many empty keys under the prefix")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="wait this long before each list request")
    args = parser.parse_args()
    storage.configure_s3(args.endpoint)
    world = get_world()
    if args.latency_ms:
        _add_latency(args.latency_ms / 1000)
    if world.is_root and args.make:
        _make(args.url, args.make)
    sequential: list[str] = []
    if world.is_root:
        started = time.monotonic()
        sequential = _sequential(args.url)
        one = time.monotonic() - started
        print(f"sequential ListObjectsV2: {len(sequential)} keys in {one:.2f} s", flush=True)
    _barrier(world)
    started = time.monotonic()
    found = list_sorted(args.url, world, args.threads)
    _barrier(world)
    parallel = time.monotonic() - started
    if world.is_root:
        same = [key.decode() for key in found.column("key").to_pylist()] == sorted(sequential)
        print(
            f"list_sorted, {world.size} rank(s) x {args.threads} threads: {found.num_rows} keys in {parallel:.2f} s; "
            f"{one / parallel:.1f}x faster; same listing: {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
