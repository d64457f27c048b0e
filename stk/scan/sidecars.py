"""Sidecar captions of the images that look for one (a list, a table without captions): each directory of a block of
images listed once and its names looked up, where asking for `stem.txt` and `stem.caption` costs two exists() (system
calls, or HEAD requests on S3) per image.

A directory is asked name by name as before where listing it costs more: few of the block's images are in it, it
holds far more entries than they need (a huge flat directory), or it cannot be listed. A caption that appears or
goes between the listing and the read is as it is when it does so between exists() and the read: one that went is
an unreadable caption (its error row), one that came is found by the next scan."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Executor

import pyarrow as pa
import pyarrow.compute as pc

from stk import storage
from stk.captions import CAPTION_EXTENSIONS, sidecar_stem

__all__ = ["Sidecars", "listed_for"]

LIST_FROM = 4  # images of a block in one directory from which it is listed rather than asked name by name
ENTRIES_PER_IMAGE, SLACK = 16, 1000  # a listing past this many entries per image it serves, and SLACK, is dropped


def _parts(image: str) -> tuple[str, str] | None:
    """The directory to list for `image`'s sidecars and its stem's name in it; None where a listing of that name would
    not answer what exists() answers (no directory part, or an empty name before the '/')."""
    directory, _, stem = sidecar_stem(image).rpartition("/")
    return (directory, stem) if directory and not directory.endswith(("/", ":")) else None


class Sidecars:
    """Where each image's sidecar caption is, from directory listings; directories not listed are asked per name."""

    def __init__(self, listed: dict[str, frozenset[str]] | None = None) -> None:
        self._listed = listed or {}  # directory: the caption names found in it (of those the block wanted)

    def find(self, image: str) -> str | None:
        """The sidecar of `image` (the preferred extension first), or None."""
        stem = sidecar_stem(image)
        directory, _, name = stem.rpartition("/")
        names = self._listed.get(directory)  # only directories that _parts accepts were listed
        if names is None:
            return next((stem + ext for ext in CAPTION_EXTENSIONS if storage.exists(stem + ext)), None)
        return next((stem + ext for ext in CAPTION_EXTENSIONS if name + ext in names), None)


def _found(directory: str, wanted: frozenset[str], images: int) -> frozenset[str] | None:
    """The names of `wanted` in `directory`; None where it is cheaper to ask for them one by one."""
    most = ENTRIES_PER_IMAGE * images + SLACK
    found = set()
    try:
        for count, name in enumerate(storage.names(directory)):
            if count > most:
                return None
            if name in wanted:
                found.add(name)
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()  # exists() finds nothing there either
    except OSError:
        return None  # no permission to list, say: exists() may still answer
    return frozenset(found)


def listed_for(todo: pa.Table, pool: Executor) -> Sidecars:
    """The sidecars of the candidates of `todo` that will look for one, each directory holding at least LIST_FROM of
    them listed once, the listings spread over `pool`."""
    caption_location = pc.fill_null(todo.column("caption_location"), "")
    looking = pc.and_(
        pc.and_(todo.column("find_sidecar"), pc.is_null(todo.column("caption"))),
        pc.and_(pc.equal(caption_location, ""), pc.is_null(todo.column("error_kind"))),
    )
    stems: defaultdict[str, list[str]] = defaultdict(list)
    for location in todo.column("location").filter(looking).to_pylist():
        parts = _parts(storage.text_name(location))
        if parts:
            stems[parts[0]].append(parts[1])
    listed = [(directory, names) for directory, names in stems.items() if len(names) >= LIST_FROM]
    found = pool.map(lambda item: _found(item[0], _wanted(item[1]), len(item[1])), listed)
    return Sidecars({d: names for (d, _), names in zip(listed, found, strict=True) if names is not None})


def _wanted(stems: list[str]) -> frozenset[str]:
    return frozenset(stem + ext for stem in stems for ext in CAPTION_EXTENSIONS)
