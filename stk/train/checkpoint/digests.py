"""The sha256 of every file of a checkpoint, and the check of a checkpoint against them.

A checkpoint's `stk-run.json` lists its files (`files`: path inside the checkpoint -> size, sha256 and the rank
that wrote it). Each rank hashes the files it has just written, from the page cache, and a resume verifies
each rank's share of the files before any model loads: a flipped byte, a truncated or an empty file, or a
missing EMA part is found in seconds and named, instead of being trained on or ending in a traceback deep
inside DeepSpeed's load. The same check reads a checkpoint for stk-export (`damage_of`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "FILES",
    "SETTINGS",
    "FileRecord",
    "checkpoint_damage",
    "damage",
    "damage_of",
    "has_digests",
    "hash_files",
    "listed_files",
    "read_record",
    "recorded_files",
]

SETTINGS = "stk-run.json"  # a checkpoint's record: the run settings it was trained with, and its files
FILES = "files"  # the key of stk-run.json that lists the checkpoint's files with their digests
FileRecord = dict[str, Any]  # {"size": bytes, "sha256": hex digest, "rank": the rank that wrote the file}


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_files(folder: str, paths: Iterable[str], rank: int) -> dict[str, FileRecord]:
    """Size and sha256 of each of `paths` (files under `folder` that this rank wrote), keyed by their path
    relative to `folder`."""
    records: dict[str, FileRecord] = {}
    for path in paths:
        name = os.path.relpath(path, folder).replace(os.sep, "/")
        records[name] = {"size": os.path.getsize(path), "sha256": _sha256(path), "rank": rank}
    return records


def listed_files(folder: str, skip: Iterable[str] = ()) -> list[str]:
    """Every file under `folder`, but those named in `skip` (paths relative to it) and temp files."""
    skipped = set(skip)
    found = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative not in skipped and not name.startswith(".tmp-"):
                found.append(path)
    return sorted(found)


def damage(folder: str, files: Mapping[str, FileRecord], rank: int, world_size: int) -> list[str]:
    """What is wrong with this rank's share of `files` (those written by a rank r with r % world_size == rank):
    one short description per missing, resized or changed file; empty when the share is whole."""
    found = []
    for name, record in sorted(files.items()):
        if int(record.get("rank", 0)) % world_size != rank:
            continue
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
            if size != record["size"]:
                found.append(f"{path}: {size} bytes, {record['size']} expected")
            elif (digest := _sha256(path)) != record["sha256"]:
                found.append(f"{path}: sha256 {digest[:16]}..., {record['sha256'][:16]}... expected")
        except FileNotFoundError:
            found.append(f"{path}: missing")
        except OSError as exc:
            found.append(f"{path}: cannot read ({exc.strerror or exc})")
    return found


def read_record(folder: str) -> dict[str, Any] | None:
    """The checkpoint `folder`'s stk-run.json, or None where it has none. A record that cannot be read raises
    ValueError."""
    try:
        with open(os.path.join(folder, SETTINGS), encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{SETTINGS} cannot be read ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{SETTINGS} holds no settings")
    return record


def recorded_files(folder: str) -> dict[str, FileRecord] | None:
    """The files a checkpoint's record lists, or None for a checkpoint saved without digests (or without
    stk-run.json). A record that cannot be read raises ValueError."""
    files = (read_record(folder) or {}).get(FILES)
    return files if isinstance(files, dict) else None


def has_digests(folder: str) -> bool:
    """Whether the checkpoint's record lists its files (one that cannot be read is found damaged later)."""
    try:
        return recorded_files(folder) is not None
    except ValueError:
        return True


def checkpoint_damage(folder: str, rank: int, world_size: int) -> list[str]:
    """What is wrong with this rank's share of the checkpoint `folder`'s files (all of them on a world of one);
    a record that cannot be read is named by rank 0."""
    try:
        files = recorded_files(folder)
    except ValueError as exc:
        return [f"{folder}/{exc}"] if rank == 0 else []
    return damage(folder, files or {}, rank, world_size)


def damage_of(folder: str) -> list[str] | None:
    """What is wrong with the checkpoint `folder`, every file checked in this process as a resume checks it (for
    stk-export, which reads one); None where its record lists no digests (saved by an older stk)."""
    folder = os.path.abspath(folder)
    return checkpoint_damage(folder, 0, 1) if has_digests(folder) else None
