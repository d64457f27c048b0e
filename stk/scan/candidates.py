"""What a scan has to look at, as columns: one row per image, from a tree, a list or a table.

A million images are a table of a few hundred bytes each, not a million Python objects: rows
become Python only a batch at a time (to stat them, fingerprint them, probe them)."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.captions import CAPTION_EXTENSIONS, sidecar_of, sidecar_stem
from stk.images.info import is_image_name
from stk.storage import name_text, text_name

__all__ = [
    "BATCH",
    "CANDIDATE_SCHEMA",
    "fingerprints",
    "from_list",
    "from_table",
    "from_tree",
    "located",
    "ready",
    "settle",
]

BATCH = 65_536  # rows turned into Python at a time

# `path` is the key in the output table and `location` where to read the image, both as tables
# hold names (stk.storage.name_text: a name that is not UTF-8 is escaped; text_name opens it).
# A tree's rows leave `location` null where it is the root joined with `path` (`ready` fills it in):
# 50 bytes a row less on the rank that plans a scan of S3.
CANDIDATE_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("location", pa.string()),
        ("size", pa.int64()),  # -1: not known yet (lists and tables are stat'ed before the work is split)
        ("mtime", pa.float64()),
        ("etag", pa.string()),
        ("caption_location", pa.string()),  # a sidecar found by the listing
        ("caption_fingerprint", pa.string()),
        ("caption", pa.string()),  # from the table
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("find_sidecar", pa.bool_()),  # look for path.txt/.caption at probe time (lists, tables)
        ("error_kind", pa.string()),
        ("error", pa.string()),
    ]
)


def _table(columns: dict[str, Any], rows: int) -> pa.Table:
    """A candidate table from the columns given; the others are their defaults."""
    defaults = {"size": -1, "mtime": 0.0, "caption_fingerprint": "", "find_sidecar": False}
    arrays = []
    for field in CANDIDATE_SCHEMA:
        value = columns.get(field.name)
        if isinstance(value, (pa.Array, pa.ChunkedArray)):
            arrays.append(value.cast(field.type))
        elif value is not None:
            arrays.append(pa.array(value, field.type))
        elif field.name in defaults:
            arrays.append(pa.array(np.full(rows, defaults[field.name]), field.type))
        else:
            arrays.append(pa.nulls(rows, field.type))
    return pa.Table.from_arrays(arrays, schema=CANDIDATE_SCHEMA)


def _sorted(table: pa.Table) -> pa.Table:
    """By path, then error kind (stable: equal rows keep their order)."""
    keys = table.append_column("_kind", pc.fill_null(table.column("error_kind"), ""))
    order = pc.sort_indices(keys, sort_keys=[("path", "ascending"), ("_kind", "ascending")])
    if np.array_equal(order.to_numpy(), np.arange(len(order))):
        return table
    return table.take(order)


def repeats(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """True where the key appeared in an earlier row."""
    order = pc.sort_indices(keys)  # stable: the first of equal keys is the earliest
    ordered = keys.take(order)
    same = np.zeros(len(keys), bool)
    if len(keys) > 1:
        same[1:] = pc.equal(ordered[1:], ordered[:-1]).to_numpy(zero_copy_only=False)
    out = np.zeros(len(keys), bool)
    out[order.to_numpy()] = same
    return out


_LISTED = pa.schema(
    [CANDIDATE_SCHEMA.field(name) for name in ("path", "location", "size", "mtime", "etag", "error_kind", "error")]
    + [pa.field("stem", pa.string())]
)
_SIDECARS = pa.schema(
    [("stem", pa.string()), ("rank", pa.int8()), ("location", pa.string()), ("fingerprint", pa.string())]
)


def _of_lists(columns: list[list[Any]], schema: pa.Schema) -> pa.Table:
    arrays = [pa.array(values, field.type) for values, field in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


def _batched_listing(
    root: str, listed: Iterable[storage.FileInfo] | None, extensions: Sequence[str]
) -> Iterator[tuple[list[list[Any]], list[list[Any]]]]:
    """The listing (`listed`, or storage.list_files) a batch at a time: image rows and sidecar rows (files with one of
    `extensions`), as column lists. An image's location is None where it is the root joined with its path."""
    prefix = storage.join(root, "")
    images: list[list[Any]] = [[] for _ in range(8)]
    sidecars: list[list[Any]] = [[] for _ in range(4)]
    for count, info in enumerate(storage.list_files(root) if listed is None else listed, 1):
        if is_image_name(info.key) or info.key.endswith("/"):
            kind = (info.error_kind or "unreadable") if info.error else None
            path, location = name_text(info.key), name_text(info.location)
            row = (
                path,
                None if location == prefix + path else location,
                info.size,
                info.mtime,
                info.etag,
                kind,
                info.error or None,
                name_text(sidecar_stem(info.key)),
            )
            for column, value in zip(images, row, strict=True):
                column.append(value)
        elif sidecar := sidecar_of(info.key, extensions):
            side = (
                name_text(sidecar[0]),
                sidecar[1],
                name_text(info.location),
                f"{info.size}:{info.mtime!r}:{info.etag or ''}",
            )
            for column, item in zip(sidecars, side, strict=True):
                column.append(item)
        if count % BATCH == 0:
            yield images, sidecars
            images, sidecars = [[] for _ in range(8)], [[] for _ in range(4)]
    yield images, sidecars


def from_tree(
    root: str, listed: Iterable[storage.FileInfo] | None = None, extensions: Sequence[str] = CAPTION_EXTENSIONS
) -> pa.Table:
    """Every image under a directory or s3:// prefix, with its sidecar caption if any (a file of its stem with one of
    `extensions`, the first preferred), and every directory that cannot be listed (an error row each); `listed`: its
    files, when listed already."""
    image_batches, sidecar_batches = [], []
    for images, sidecars in _batched_listing(root, listed, extensions):
        image_batches.append(_of_lists(images, _LISTED))
        sidecar_batches.append(_of_lists(sidecars, _SIDECARS))
    found = pa.concat_tables(image_batches)
    sidecars = pa.concat_tables(sidecar_batches)
    # the preferred extension of each stem; of two with the same one, the first listed
    sidecars = sidecars.take(pc.sort_indices(sidecars, sort_keys=[("stem", "ascending"), ("rank", "ascending")]))
    sidecars = sidecars.filter(pa.array(~repeats(sidecars.column("stem"))))
    match = pc.index_in(found.column("stem"), value_set=sidecars.column("stem"))
    columns = {name: found.column(name) for name in _LISTED.names[:-1]}
    columns["caption_location"] = sidecars.column("location").take(match)
    columns["caption_fingerprint"] = pc.fill_null(sidecars.column("fingerprint").take(match), "")
    return _sorted(_table(columns, found.num_rows))


def from_list(lines: Iterable[str]) -> pa.Table:
    """Paths or URLs, one per line (blank lines and '#' comments ignored); kept as given."""
    kept = [name_text(line) for line in (raw.strip() for raw in lines) if line and not line.startswith("#")]
    paths = pa.array(kept, pa.string())
    relisted = repeats(paths)
    columns = {
        "path": paths,
        "location": paths,
        "find_sidecar": np.ones(len(kept), bool),
        "error_kind": pc.if_else(pa.array(relisted), "duplicate", pa.nulls(len(kept), pa.string())),
        "error": pc.if_else(pa.array(relisted), "listed more than once", pa.nulls(len(kept), pa.string())),
    }
    return _sorted(_table(columns, len(kept)))


def _escapes(path: str) -> bool:
    return path.startswith("/") or "://" in path or ".." in path.split("/")


def _table_path(given: str, root: str) -> tuple[str, str, str | None, str | None]:
    """(path shown, key for repeats, error kind, error) of one row's path."""
    raw = text_name(given).replace("\\", "/")  # a table of stk's names, or Windows separators
    escapes = bool(raw) and _escapes(raw)
    path = posixpath.normpath(raw) if raw else ""
    shown = name_text(raw if escapes else (path or "<empty>"))  # an escaping path is reported as written
    if not path:
        return shown, "", "bad_row", "row has no path"
    if escapes:
        return shown, name_text(path), "path_escapes_root", f"path {given!r} escapes the root {root!r}"
    return shown, shown, None, None


def _table_location(path: str, kind: str | None, root: str) -> str:
    return name_text(storage.join(root, "" if kind == "bad_row" else posixpath.normpath(text_name(path))))


# A path a table holds as it is: relative, '/'-separated, no empty, '.' or '..' part, no backslash.
# It is its own normal form and name: only the other paths are looked at one by one.
_PLAIN, _DOTS = r"^(?:[^/\\]+/)*[^/\\]+$", r"(?:^|/)\.\.?(?:/|$)"


def _plain(paths: pa.ChunkedArray | pa.Array) -> np.ndarray:
    good = pc.and_(pc.match_substring_regex(paths, _PLAIN), pc.invert(pc.match_substring_regex(paths, _DOTS)))
    return pc.fill_null(good, False).to_numpy(zero_copy_only=False)


def _replaced(values: pa.Array, odd: np.ndarray, replacements: list[str | None]) -> pa.Array:
    """`values` with the rows where `odd` is true replaced, in order."""
    if not odd.any():
        return values
    return pc.replace_with_mask(values, pa.array(odd), pa.array(replacements, pa.string()))


def _table_paths(given: pa.Array, root: str) -> dict[str, pa.Array]:
    """The path, repeat key, error kind and error of each row of a table."""
    odd = ~_plain(given)
    checked = [_table_path(path, root) for path in given.filter(pa.array(odd)).to_pylist()]
    nulls = pa.nulls(len(given), pa.string())
    return {
        name: _replaced(nulls if i > 1 else given, odd, [c[i] for c in checked])
        for i, name in enumerate(("path", "key", "error_kind", "error"))
    }


def _locations(found: pa.Table, root: str) -> pa.Array:
    """Where each row's image is: the root joined with its normal path ('' for a row with none)."""
    prefix = storage.join(root, "")
    paths, kinds = found.column("path").combine_chunks(), found.column("error_kind").combine_chunks()
    fast = _plain(paths) & pc.fill_null(pc.not_equal(kinds, "bad_row"), True).to_numpy(zero_copy_only=False)
    if "\\" in prefix or storage.printable(prefix) != prefix:
        fast[:] = False  # a root with a name that is not UTF-8: every location is escaped by name_text
    odd = ~fast
    mask = pa.array(odd)
    pairs = zip(paths.filter(mask).to_pylist(), kinds.filter(mask).to_pylist(), strict=True)
    slow: list[str | None] = [_table_location(path, kind, root) for path, kind in pairs]
    return _replaced(pc.binary_join_element_wise(prefix, paths, ""), odd, slow)


def from_table(rows: pa.Table, root: str) -> pa.Table:
    """Rows of an existing table (stk.metadata.read_columns); paths are relative to `root` and may
    not leave it."""
    checked = _table_paths(rows.column("path").combine_chunks(), root)
    relisted = pa.array(repeats(checked["key"]) & pc.is_null(checked["error_kind"]).to_numpy(zero_copy_only=False))
    columns = {
        "path": checked["path"],
        "error_kind": pc.if_else(relisted, "duplicate", checked["error_kind"]),
        "error": pc.if_else(relisted, "path appears in more than one row", checked["error"]),
        "caption": rows.column("caption"),
        "width": rows.column("width"),
        "height": rows.column("height"),
        "find_sidecar": rows.column("caption").is_null(),
    }
    del checked
    found = _sorted(_table(columns, rows.num_rows))
    return found.set_column(1, "location", _locations(found, root))


Stat = tuple[int, float, str | None, str | None, str | None]  # size, mtime, etag, error kind, error


def _stat_many(locations: list[str]) -> list[Stat]:
    out: list[Stat] = []
    for location in locations:
        try:
            info = storage.stat(text_name(location))
        except FileNotFoundError:
            out.append((-1, 0.0, None, "not_found", "no such file"))
        except OSError as exc:
            out.append((-1, 0.0, None, "unreadable", f"cannot stat: {exc.strerror or exc}"))
        else:
            out.append((info.size, info.mtime, info.etag, info.error_kind, info.error))
    return out


def fingerprint(
    size: int,
    mtime: float,
    etag: str | None,
    caption_fingerprint: str | None,
    caption: str | None,
    width: int | None,
    height: int | None,
) -> str:
    """Changes whenever the image or its caption source changes: reuse is keyed on it."""
    table = f"|{caption!r}|{width}|{height}" if caption or width else ""
    return f"{size}:{mtime!r}:{etag or ''}|{caption_fingerprint or ''}{table}"


_STATED = ("size", "mtime", "etag", "error_kind", "error")  # what a stat fills in, in Stat's order


def _stat_rows(batch: pa.RecordBatch, rows: np.ndarray, pool: ThreadPoolExecutor) -> pa.RecordBatch:
    locations = batch.column("location").take(pa.array(rows)).to_pylist()
    parts = [locations[start : start + 256] for start in range(0, len(locations), 256)]
    stats = [stat for part in pool.map(_stat_many, parts) for stat in part]
    columns = {name: batch.column(name).to_pylist() for name in _STATED}
    for row, stat in zip(rows.tolist(), stats, strict=True):
        for name, value in zip(_STATED, stat, strict=True):
            columns[name][row] = value
    for name, values in columns.items():
        index = batch.schema.get_field_index(name)
        batch = batch.set_column(index, batch.schema.field(index), pa.array(values, batch.schema.field(index).type))
    return batch


def _settle_batch(batch: pa.RecordBatch, pool: ThreadPoolExecutor) -> pa.RecordBatch:
    unknown = batch.column("size").to_numpy() < 0
    rows = np.flatnonzero(unknown & pc.is_null(batch.column("error_kind")).to_numpy(zero_copy_only=False))
    return _stat_rows(batch, rows, pool) if len(rows) else batch


def settle(found: pa.Table, threads: int) -> pa.Table:
    """Fill in size/mtime of the rows that came without them (lists and tables): the work is split by bytes."""
    with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
        batches = [_settle_batch(batch, pool) for batch in found.to_batches(BATCH)]
    return pa.Table.from_batches(batches, schema=CANDIDATE_SCHEMA)


_FINGERPRINTED = ("size", "mtime", "etag", "caption_fingerprint", "caption", "width", "height")


def fingerprints(rows: pa.Table | pa.RecordBatch) -> pa.Array:
    """Each settled row's fingerprint. Made where it is needed, a block or a batch at a time, not kept for
    every row: 55 bytes a row on the rank that plans."""
    columns = [rows.column(name).to_pylist() for name in _FINGERPRINTED]
    return pa.array([fingerprint(*values) for values in zip(*columns, strict=True)], pa.string())


def located(rows: pa.Table, root: str) -> pa.Table:
    """`rows` (candidates or records) with the locations a tree's rows leave out filled in; `root` as from_tree
    was given it (lists' and tables' rows have every location)."""
    where = rows.schema.get_field_index("location")
    locations = rows.column(where)
    if not locations.null_count:
        return rows
    joined = pc.binary_join_element_wise(storage.join(root, ""), rows.column("path"), "")
    return rows.set_column(where, rows.schema.field(where), pc.coalesce(locations, joined))


def ready(todo: pa.Table, root: str) -> pa.Table:
    """A block's settled candidates as probe takes them: every location, and each row's fingerprint."""
    todo = located(todo, root)
    return todo.append_column("fingerprint", fingerprints(todo))
