"""bench/scale.py's floors, each run as its own process so that its peak RSS is its own; prints one JSON line: what it
counted, and its seconds without the interpreter's start and imports.

    python bench/scale_floors.py stat TABLE ROOT [--threads 8]   read the table, os.stat every path on 8 threads
                                                                   (twice, the second pass timed; 256 paths a task)
    python bench/scale_floors.py list ENDPOINT BUCKET PREFIX       one plain sequential ListObjectsV2 loop
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
from scale_data import s3_client


def stat_floor(table: str, root: str, threads: int) -> tuple[int, float]:
    """What any scan of a table must do: read it, and learn each file's size and change time. Done twice, the second
    pass timed: the first warms the page and inode caches, as they are for stk-scan, which runs after it. A task stats
    256 paths, as stk-scan's do: a future per path took the floor 4x as long (29.5 s against 7.3 s at 1M)."""

    def stat_all(paths: list[str]) -> int:
        for path in paths:
            os.stat(os.path.join(root, path))
        return len(paths)

    for _ in range(2):
        started = time.perf_counter()
        paths = pq.read_table(table, columns=["path"]).column("path").to_pylist()
        with ThreadPoolExecutor(threads) as pool:
            count = sum(pool.map(stat_all, [paths[i : i + 256] for i in range(0, len(paths), 256)]))
        seconds = time.perf_counter() - started
        del paths
    return count, seconds


def list_floor(endpoint: str, bucket: str, prefix: str) -> tuple[int, float]:
    """What any single lister does: ListObjectsV2 pages of 1000 keys, one after the other (timed from the first
    request: the client's making, boto3's service model read, is not listing)."""
    client, keys, token = s3_client(endpoint), 0, None
    started = time.perf_counter()
    while True:
        more = {"ContinuationToken": token} if token else {}
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", **more)
        keys += len(page.get("Contents", []))
        token = page.get("NextContinuationToken")
        if not token:
            return keys, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="floor", required=True)
    stat = sub.add_parser("stat")
    stat.add_argument("table")
    stat.add_argument("root")
    stat.add_argument("--threads", type=int, default=8)
    listing = sub.add_parser("list")
    for name in ("endpoint", "bucket", "prefix"):
        listing.add_argument(name)
    args = parser.parse_args()
    if args.floor == "stat":
        count, seconds = stat_floor(args.table, args.root, args.threads)
    else:
        count, seconds = list_floor(args.endpoint, args.bucket, args.prefix)
    print(json.dumps({"count": count, "seconds": seconds}))


if __name__ == "__main__":
    main()
