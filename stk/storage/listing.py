"""A directory or an s3:// prefix listed by every rank, with threads in each: the same files as
storage.list_files, sorted by key.

One lister reads S3 at one page (1,000 keys) a round trip: 100M keys at ~100 ms a page take
hours. Here rank 0 first cuts the tree into parts, the ranks list the parts (each with its
threads), and rank 0 puts them back in key order.

Local: a part is a subdirectory, found level by level from the root until there are enough.

S3: a part is a prefix, listed with delimiter "/": its names at its level, and the whole tree of
each common prefix among them. A level that fits in one page is listed at once and its common
prefixes become levels of their own; a level of more names (a flat prefix: 1M keys with no "/")
is cut by the first characters of its names ("img_0", "img_1", ...), found with one-key probes
that jump past each character in turn (StartAfter), breadth first until there are enough parts.
Parts are prefixes, so they cover every name whatever the keys and whatever order the store
lists them in: SeaweedFS sorts a directory as its bare name ("a/x" < "a.jpg"), S3 by bytes. No
cut goes inside a directory's name.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.cluster.world import World, split_work
from stk.log import get_logger
from stk.storage import s3
from stk.storage.base import FileInfo
from stk.storage.local import LocalBackend

__all__ = ["file_infos", "list_sorted"]

log = get_logger("storage.listing")

_PARTS_PER_THREAD = 4  # parts differ in size: more parts than threads keeps every thread busy to the end
_PAGE = 1000  # S3's largest page
_MAX_CHILDREN = 64  # probes for one name prefix; past it the prefix is one range (cuts only balance the work)
_MAX_DEPTH = 16  # characters deep that cuts are looked for
_BATCH = 10_000  # FileInfo made at a time from the table
_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("location", pa.binary()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("etag", pa.string()),
        ("error", pa.string()),
        ("error_kind", pa.string()),
    ]
)
_ROOT = "stk.root"  # a listing's schema metadata: the root its keys are relative to
_LAST = "\U0010ffff"  # the last character: "ab" + _LAST sorts after every name of "ab" and a few more characters

P = TypeVar("P")


class _Parts(Protocol[P]):
    root: str

    def plan(self, wanted: int, pool: ThreadPoolExecutor) -> tuple[list[FileInfo], list[P]]: ...

    def list(self, part: P) -> list[FileInfo]: ...


def list_sorted(root: str, world: World, threads: int) -> pa.Table:
    """Every file under `root` (as storage.list_files gives them), sorted by key, one row each with
    FileInfo's fields as columns (keys and locations as bytes: a local name need not be UTF-8): the
    whole listing on rank 0, an empty table on the others. Every rank calls it; an error on any
    rank is raised on all. Columns, not a FileInfo per file: 1M of those are ~350 MB on rank 0.
    A location is null where it is the root joined with its key, as nearly all are (file_infos puts
    it back): 50 bytes a file less on S3."""
    if root.startswith("s3://"):
        table = _list_parts(_S3Parts(root), world, max(threads, 1))
    else:
        table = _list_parts(_LocalParts(root), world, max(threads, 1))
    return table.replace_schema_metadata({_ROOT: root})


def file_infos(table: pa.Table) -> Iterator[FileInfo]:
    """The rows of a list_sorted table as FileInfo, made a batch at a time. Each batch is let go
    once it is read: a caller that passes its only reference holds the listing and what it makes
    of it no longer than it takes to make it."""
    prefix = storage.join(table.schema.metadata[_ROOT.encode()].decode(errors="surrogateescape"), "")
    batches = table.to_batches(max_chunksize=_BATCH)[::-1]
    del table
    while batches:
        batch = batches.pop()
        columns = [batch.column(name).to_pylist() for name in _SCHEMA.names]
        for raw_key, raw_location, *rest in zip(*columns, strict=True):
            key = raw_key.decode(errors="surrogateescape")
            location = raw_location.decode(errors="surrogateescape") if raw_location else prefix + key
            yield FileInfo(key, location, *rest)


def _table(infos: list[FileInfo], root: str) -> pa.Table:
    prefix = storage.join(root, "")  # a key's location is prefix + key where list_files gives it as join(root, key)
    columns = [
        [info.key.encode(errors="surrogateescape") for info in infos],
        [
            None if info.location == prefix + info.key else info.location.encode(errors="surrogateescape")
            for info in infos
        ],
        *([getattr(info, name) for info in infos] for name in _SCHEMA.names[2:]),
    ]
    return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, _SCHEMA, strict=True)], schema=_SCHEMA)


def _list_parts(parts: _Parts[P], world: World, threads: int) -> pa.Table:
    listed: list[pa.Table] = []

    def plan() -> tuple[int, list[list[P]]]:
        done, todo = parts.plan(world.size * threads * _PARTS_PER_THREAD, pool)
        listed.append(_by_key(_table(done, parts.root)))
        return len(todo), [todo[rank :: world.size] for rank in range(world.size)]

    def work(_: int, share: list[P]) -> pa.Table:
        tables = pool.map(lambda part: _by_key(_table(parts.list(part), parts.root)), share)
        return pa.concat_tables([_table([], parts.root), *tables])

    def finish(count: int, results: list[pa.Table]) -> None:
        listed.extend(results)
        files = sum(table.num_rows for table in listed)
        log.debug("listed %d files in %d parts on %d rank(s) x %d threads", files, count, world.size, threads)

    with ThreadPoolExecutor(threads) as pool:
        split_work(world, plan, work, finish)
    return _merged(listed[0], listed[1:]) if world.is_root else _table([], parts.root)


def _by_key(table: pa.Table) -> pa.Table:
    return table.take(pc.sort_indices(table, sort_keys=[("key", "ascending")]))


def _merged(top: pa.Table, ranks: list[pa.Table]) -> pa.Table:
    """The top levels' files and the ranks' parts (a chunk each), every one sorted by key, put in key
    order without a copy: a part is a subdirectory or a prefix, so its keys come together in key
    order, with the top levels' files between parts. Sorting the whole instead holds it three times
    (its parts, their concatenation, the result); that is left for runs that overlap after all."""
    runs = sorted((run for table in ranks for run in table.to_batches() if run.num_rows), key=_first)
    keys = top.column("key").to_numpy(zero_copy_only=False)
    cuts = [0, *(int(cut) for cut in np.searchsorted(keys, [_first(run) for run in runs])), top.num_rows]
    pieces = [top.slice(start, stop - start) for start, stop in itertools.pairwise(cuts)]
    batches = [b for i, piece in enumerate(pieces) for b in [*piece.to_batches(), *runs[i : i + 1]] if b.num_rows]
    merged = pa.Table.from_batches(batches, _SCHEMA)
    if all(_last(before) < _first(after) for before, after in itertools.pairwise(batches)):
        return merged
    return _by_key(merged)


def _first(run: pa.RecordBatch) -> bytes:
    return bytes(run.column(0)[0].as_py())


def _last(run: pa.RecordBatch) -> bytes:
    return bytes(run.column(0)[-1].as_py())


class _LocalParts:
    """Subdirectories, each walked whole by one thread."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.local = LocalBackend()

    def plan(self, wanted: int, pool: ThreadPoolExecutor) -> tuple[list[FileInfo], list[str]]:
        """The files of the top levels (listed here) and the subdirectories below them, at least
        `wanted` of them where the tree has that many."""
        done: list[FileInfo] = []
        levels = [""]
        while levels and len(levels) < wanted:
            found = list(pool.map(lambda rel_dir: self.local.level(self.root, rel_dir), levels))
            levels = []
            for files, subdirs in found:
                done.extend(files)
                levels.extend(subdirs)
        return done, levels

    def list(self, part: str) -> list[FileInfo]:
        return list(self.local.walk(self.root, [part]))


class _S3Parts:
    """Prefixes (relative to the root), each listed by one thread: its names at its level, and the
    whole tree of each common prefix among them."""

    def __init__(self, root: str) -> None:
        self.root = root

    def plan(self, wanted: int, pool: ThreadPoolExecutor) -> tuple[list[FileInfo], list[str]]:
        """Levels opened from the root (their files listed here) until there are `wanted` parts;
        a level of more than a page is cut by the first characters of its names."""
        done: list[FileInfo] = []
        parts: list[str] = []
        levels = [""]
        while levels and len(levels) + len(parts) < wanted:
            pages = list(pool.map(self._first_page, levels))
            levels = []
            for level, entries in pages:
                if len(entries) > _PAGE:
                    exact, cut = self._cut(level, self._shared(level, entries), wanted, pool)
                    done.extend(exact)
                    parts.extend(cut)
                    continue
                done.extend(entries)
                levels.extend(e.key for e in entries if e.size < 0)  # common prefixes
        return [e for e in done if not e.key.endswith("/")], parts + levels

    def _first_page(self, level: str) -> tuple[str, list[FileInfo]]:
        """The names of `level`, all of them when they fit in one page (else one more than a page)."""
        entries = s3.list_entries(self.root, level, levels=True, keys=_PAGE)
        return level, [entry for _, entry in zip(range(_PAGE + 1), entries, strict=False)]

    def _shared(self, level: str, first: list[FileInfo]) -> str:
        """The longest prefix of every name of `level`: of the prefix its first names share, as
        much as one-key probes (a binary search) find no name past. A prefix that flat keys share
        ("laion_part_000") would otherwise cost two probes a character."""
        names = [entry.key[len(level) :] for entry in first]
        shared = os.path.commonprefix([min(names), max(names)])  # noqa: RUF071  (characters, not path parts)
        low, high = 0, len(shared)
        while low < high:
            middle = (low + high + 1) // 2
            past = level + shared[:middle] + _LAST
            if next(s3.list_entries(self.root, level, past, levels=True, keys=1), None) is None:
                low = middle
            else:
                high = middle - 1
        return shared[:low]

    def _cut(self, level: str, start: str, wanted: int, pool: ThreadPoolExecutor) -> tuple[list[FileInfo], list[str]]:
        """`level` cut at the first characters of its names, breadth first: the names that end
        where a cut is made, and the prefixes below the cuts. Where cutting every prefix of a
        depth would give far more parts than wanted (each costs a request, and each cut a probe
        per character), only the first few are cut. Every name starts with `start`."""
        nodes: list[str] = [start]
        whole: list[str] = []
        exact: list[FileInfo] = []
        fanout = 2  # characters per cut prefix, as the last depth had them
        for _ in range(_MAX_DEPTH):
            short = wanted - len(nodes) - len(whole)
            if not nodes or short <= 0:
                break
            take = len(nodes) if len(nodes) * fanout <= 4 * wanted else -(-short // (fanout - 1))
            found = list(pool.map(lambda node: self._children(level, node), nodes[:take]))
            deeper: list[str] = []
            for node, (children, named) in zip(nodes, found, strict=False):
                if children:
                    deeper.extend(node + child for child in children)
                    exact.extend(named)
                else:
                    whole.append(node)
            cut = sum(1 for children, _ in found if children)
            fanout = max(2, len(deeper) // max(cut, 1))
            nodes = deeper + nodes[take:]
        return exact, [level + node for node in nodes + whole]

    def _children(self, level: str, node: str) -> tuple[list[str] | None, list[FileInfo]]:
        """The characters that follow `node` in the names of `level`, and the object named `node`
        itself if any; None where `node` names a directory (no cut goes inside its name) or has
        more than _MAX_CHILDREN. One probe per character: each jumps past the names it starts."""
        children: list[str] = []
        named: list[FileInfo] = []
        after = ""  # the first probe has none: SeaweedFS sorts directory `node` as `node`, not after it
        while len(children) <= _MAX_CHILDREN:
            entry = next(s3.list_entries(self.root, level + node, after, levels=True, keys=1), None)
            if entry is None:
                return children, named
            name = entry.key[len(level) :]
            if name == node:
                named.append(entry)
                after = entry.key
                continue
            child = name[len(node)]
            if child == "/":
                return None, []
            children.append(child)
            after = level + node + child + _LAST
        return None, []

    def list(self, part: str) -> list[FileInfo]:
        """The files under `part` (a prefix), in key order."""
        out: list[FileInfo] = []
        for entry in s3.list_entries(self.root, part, levels=True):
            if entry.size < 0:
                out.extend(s3.list_entries(self.root, entry.key))
            else:
                out.append(entry)
        return [info for info in out if not info.key.endswith("/")]  # not folder markers ("a/")
