"""What a scan has to look at: one Candidate per image, from a tree, a list or a table."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stk import storage
from stk.captions import CAPTION_EXTENSIONS, sidecar_stem
from stk.imageinfo import is_image_name
from stk.metadata import TableRow

__all__ = ["Candidate", "from_list", "from_table", "from_tree", "stat_unknown"]


@dataclass
class Candidate:
    """One image to scan. `path` is its key in the output table; `location` is where to read it.

    Size -1 means not known yet (lists and tables are stat'ed before splitting the work). A name
    that is not UTF-8 is kept as it is in `location` and stored escaped in `path`
    (stk.storage.names)."""

    path: str
    location: str
    size: int = -1
    mtime: float = 0.0
    etag: str | None = None
    caption_location: str | None = None
    caption_fingerprint: str = ""
    caption: str | None = None
    width: int | None = None
    height: int | None = None
    find_sidecar: bool = False  # look for path.txt/.caption at probe time (lists, tables)
    error_kind: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.path = storage.name_text(self.path)

    @property
    def shown_location(self) -> str:
        """`location` as records and errors.jsonl hold it (UTF-8, names escaped)."""
        return storage.name_text(self.location)

    @property
    def fingerprint(self) -> str:
        """Changes whenever the image or its caption source changes: reuse is keyed on it."""
        table = f"|{self.caption!r}|{self.width}|{self.height}" if self.caption or self.width else ""
        return f"{self.size}:{self.mtime!r}:{self.etag or ''}|{self.caption_fingerprint}{table}"


def from_tree(root: str) -> list[Candidate]:
    """Every image under a directory or s3:// prefix, with its sidecar caption if any, and every
    directory that cannot be listed (an error row each)."""
    images: list[storage.FileInfo] = []
    sidecars: dict[str, storage.FileInfo] = {}
    for info in storage.list_files(root):
        ext = posixpath.splitext(info.key)[1].lower()
        if is_image_name(info.key) or info.key.endswith("/"):
            images.append(info)
        elif ext in CAPTION_EXTENSIONS:
            stem = sidecar_stem(info.key)
            known = sidecars.get(stem)
            if known is None or CAPTION_EXTENSIONS.index(ext) < CAPTION_EXTENSIONS.index(
                posixpath.splitext(known.key)[1].lower()
            ):
                sidecars[stem] = info
    out = []
    for info in images:
        side = sidecars.get(sidecar_stem(info.key))
        cand = Candidate(info.key, info.location, info.size, info.mtime, info.etag)
        if side is not None:
            cand.caption_location = side.location
            cand.caption_fingerprint = f"{side.size}:{side.mtime!r}:{side.etag or ''}"
        if info.error:
            cand.error_kind, cand.error = info.error_kind or "unreadable", info.error
        out.append(cand)
    return sorted(out, key=lambda c: c.path)


def from_list(lines: Iterable[str]) -> list[Candidate]:
    """Paths or URLs, one per line (blank lines and '#' comments ignored); kept as given."""
    out: list[Candidate] = []
    seen: set[str] = set()
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cand = Candidate(line, line, find_sidecar=True)
        if line in seen:
            cand.error_kind, cand.error = "duplicate", "listed more than once"
        seen.add(line)
        out.append(cand)
    return sorted(out, key=lambda c: (c.path, c.error_kind or ""))


def _escapes(path: str) -> bool:
    return path.startswith("/") or "://" in path or ".." in path.split("/")


def from_table(rows: Iterable[TableRow], root: str) -> list[Candidate]:
    """Rows of an existing table; paths are relative to `root` and may not leave it."""
    out: list[Candidate] = []
    seen: set[str] = set()
    for row in rows:
        raw = storage.text_name(row.path).replace("\\", "/")  # a table of stk's names, or Windows separators
        escapes = bool(raw) and _escapes(raw)
        path = posixpath.normpath(raw) if raw else ""
        cand = Candidate(
            raw if escapes else (path or "<empty>"),  # an escaping path is reported as written
            storage.join(root, path),
            caption=row.caption,
            width=row.width,
            height=row.height,
            find_sidecar=row.caption is None,
        )
        if not path:
            cand.error_kind, cand.error = "bad_row", "row has no path"
        elif escapes:
            cand.error_kind, cand.error = "path_escapes_root", f"path {row.path!r} escapes the root {root!r}"
        elif path in seen:
            cand.error_kind, cand.error = "duplicate", "path appears in more than one row"
        seen.add(path)
        out.append(cand)
    return sorted(out, key=lambda c: (c.path, c.error_kind or ""))


def _stat_one(cand: Candidate) -> None:
    try:
        info = storage.stat(cand.location)
    except FileNotFoundError:
        cand.error_kind, cand.error = "not_found", "no such file"
    except OSError as exc:
        cand.error_kind, cand.error = "unreadable", f"cannot stat: {exc.strerror or exc}"
    else:
        cand.size, cand.mtime, cand.etag = info.size, info.mtime, info.etag
        cand.error_kind, cand.error = info.error_kind, info.error


def stat_unknown(cands: list[Candidate], threads: int) -> None:
    """Fill in size/mtime for candidates that came without them (needed to split by bytes)."""
    todo = [c for c in cands if c.size < 0 and c.error is None]
    with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
        list(pool.map(_stat_one, todo))
