"""Sidecar captions of the images that look for one (a list, a table without captions): each directory of a block of
images listed once and its names looked up, where asking for `stem.txt` and `stem.caption` costs two exists() (system
calls, or HEAD requests on S3) per image.

A directory is asked name by name as before where listing it costs more: few of the block's images are in it, it
holds far more entries than they need (a huge flat directory), or it cannot be listed. A caption that appears or
goes between the listing and the read is as it is when it does so between exists() and the read: one that went is
an unreadable caption (its error row), one that came is not seen (as one made just after exists() was not)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
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
    """Where each image's sidecar caption is (a file of its stem with one of `extensions`, the first preferred): known
    for the images of the directories listed, asked per name for the others."""

    def __init__(
        self, extensions: Sequence[str] = CAPTION_EXTENSIONS, known: dict[str, str | None] | None = None
    ) -> None:
        self.extensions = tuple(extensions)
        self._known = known or {}  # image: its sidecar, None where it has none

    def find(self, image: str) -> str | None:
        """The sidecar of `image` (the preferred extension first), or None."""
        if image in self._known:
            return self._known[image]
        stem = sidecar_stem(image)
        return next((stem + ext for ext in self.extensions if storage.exists(stem + ext)), None)


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


def listed_for(todo: pa.Table, pool: Executor, extensions: Sequence[str] = CAPTION_EXTENSIONS) -> Sidecars:
    """The sidecars with `extensions` of the candidates of `todo` that will look for one, each directory holding at
    least LIST_FROM of them listed once, the listings spread over `pool`."""
    caption_location = pc.fill_null(todo.column("caption_location"), "")
    looking = pc.and_(
        pc.and_(todo.column("find_sidecar"), pc.is_null(todo.column("caption"))),
        pc.and_(pc.equal(caption_location, ""), pc.is_null(todo.column("error_kind"))),
    )
    images: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)  # directory: (image, its stem's name)
    for location in todo.column("location").filter(looking).to_pylist():
        image = storage.text_name(location)
        parts = _parts(image)
        if parts:
            images[parts[0]].append((image, parts[1]))
    listed = [(directory, named) for directory, named in images.items() if len(named) >= LIST_FROM]
    found = pool.map(lambda item: _found(item[0], _wanted(item[1], extensions), len(item[1])), listed)
    known: dict[str, str | None] = {}
    for (directory, named), names in zip(listed, found, strict=True):
        if names is not None:
            known.update((image, _first(directory, stem, names, extensions)) for image, stem in named)
    return Sidecars(extensions, known)


def _first(directory: str, stem: str, names: frozenset[str], extensions: Sequence[str]) -> str | None:
    return next((f"{directory}/{stem}{ext}" for ext in extensions if stem + ext in names), None)


def _wanted(named: list[tuple[str, str]], extensions: Sequence[str]) -> frozenset[str]:
    return frozenset(stem + ext for _, stem in named for ext in extensions)
