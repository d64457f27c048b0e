"""One rank's shard writer: records in, closed and checksummed shards out, one at a time.

A shard is written as WORK_DIR/<prefix>-<seq>.h5.tmp and becomes CACHE/shards/<prefix>-<seq>.h5
(renamed in place, copied across filesystems, or uploaded to S3) only once it is closed and its
sha256 taken; only then does the caller hear of it (`on_shard_done`) and list it in the manifest.
A writer killed before that leaves a .tmp file that nothing lists, and that the next writer in
the same WORK_DIR removes (stk.shards.staging); one whose disk fails removes it itself.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
import zstandard

from stk import storage
from stk.shards.layout import (
    FORMAT,
    HEADER,
    KEY_BYTES,
    SHARDS_DIR,
    TEXT,
    TEXT_CHUNK,
    VERSION,
    ZSTD_FILTER,
    ZSTD_LEVEL,
    compress,
    encode_key,
    file_sha256,
    latent_group,
    open_h5,
    shard_location,
)
from stk.shards.records import LatentRecord, TextRecord
from stk.shards.staging import STAGED_SUFFIX, StagedFile, remove_stale
from stk.storage.local import fsync_dir

__all__ = ["ShardInfo", "ShardWriter"]

_KEY = f"S{KEY_BYTES}"
_RESERVED_TEXT_NAMES = {"key", "length"}


@dataclass
class ShardInfo:
    """A finished shard, as `on_shard_done` receives it; the manifest lists all but the keys."""

    name: str  # file name under CACHE/shards/
    latents: int
    texts: int
    bytes: int
    sha256: str
    latent_keys: list[str] = field(default_factory=list)
    text_keys: list[str] = field(default_factory=list)


def _little(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")


def _pair(value: tuple[int, int], what: str, key: str) -> tuple[int, int]:
    if len(value) != 2:
        raise ValueError(f"latent {key}: {what} must be 2 integers, got {value!r}")
    return int(value[0]), int(value[1])


class _LatentGroup:
    """One latent shape's datasets in an open shard: payloads go to the file as they come, the
    per-record metadata is kept and written when the shard closes."""

    def __init__(self, file: h5py.File, record: LatentRecord) -> None:
        self.shape = tuple(record.mean.shape)
        self.dtype = _little(record.mean.dtype)
        self.group = file.create_group(latent_group(self.shape))
        self.group.attrs["dtype"] = self.dtype.str
        self.has_logvar = record.logvar is not None
        self.payloads = [self._payload(name) for name in (("mean", "logvar") if self.has_logvar else ("mean",))]
        self.keys: list[bytes] = []
        self.text_keys: list[bytes] = []
        self.sizes: list[tuple[int, int]] = []
        self.crops: list[tuple[int, int]] = []
        self.paths: list[str] = []

    def _payload(self, name: str) -> h5py.Dataset:
        return self.group.create_dataset(
            name,
            shape=(0, *self.shape),
            maxshape=(None, *self.shape),
            chunks=(1, *self.shape),
            dtype=self.dtype,
            compression=ZSTD_FILTER,
            compression_opts=(ZSTD_LEVEL,),
            allow_unknown_filter=True,  # stk writes compressed chunks itself: HDF5 never runs the filter
        )

    def check(self, record: LatentRecord) -> None:
        if _little(record.mean.dtype) != self.dtype:
            raise ValueError(f"latent {record.key}: dtype {record.mean.dtype} differs from this cache's {self.dtype}")
        if (record.logvar is not None) != self.has_logvar:
            raise ValueError(f"latent {record.key}: either every latent of a cache has a logvar or none has")

    def add(self, record: LatentRecord, cctx: zstandard.ZstdCompressor) -> int:
        """Append one record; the bytes it adds to the shard."""
        arrays = (record.mean, record.logvar) if record.logvar is not None else (record.mean,)
        frames = [compress(array, cctx) for array in arrays]
        row = len(self.keys)
        origin = (row,) + (0,) * len(self.shape)
        for dataset, frame in zip(self.payloads, frames, strict=True):
            dataset.resize(row + 1, axis=0)
            dataset.id.write_direct_chunk(origin, frame)
        self.keys.append(encode_key(record.key))
        self.text_keys.append(encode_key(record.text_key))
        self.sizes.append(_pair(record.original_size, "original_size", record.key))
        self.crops.append(_pair(record.crop_top_left, "crop_top_left", record.key))
        self.paths.append(record.path)
        return sum(len(f) for f in frames) + 2 * KEY_BYTES + 16 + len(record.path)

    def finish(self) -> None:
        self.group.create_dataset("key", data=np.array(self.keys, dtype=_KEY))
        self.group.create_dataset("text_key", data=np.array(self.text_keys, dtype=_KEY))
        self.group.create_dataset("original_size", data=np.array(self.sizes, dtype=np.int32).reshape(-1, 2))
        self.group.create_dataset("crop_top_left", data=np.array(self.crops, dtype=np.int32).reshape(-1, 2))
        self.group.create_dataset("path", data=self.paths, dtype=h5py.string_dtype())


class _TextGroup:
    """/text in an open shard: each array's zstd frames appended to its flat `data`, the rest
    kept and written when the shard closes."""

    def __init__(self, file: h5py.File, record: TextRecord) -> None:
        self.group = file.create_group(TEXT)
        self.names = sorted(record.arrays)
        self.group.attrs["arrays"] = self.names
        self.dtypes = {name: _little(record.arrays[name].dtype) for name in self.names}
        self.ndims = {name: record.arrays[name].ndim for name in self.names}
        self.data: dict[str, h5py.Dataset] = {}
        for name in self.names:
            sub = self.group.create_group(name)
            sub.attrs["dtype"] = self.dtypes[name].str
            self.data[name] = sub.create_dataset(
                "data", shape=(0,), maxshape=(None,), chunks=(TEXT_CHUNK,), dtype=np.uint8
            )
        self.ends: dict[str, list[int]] = {name: [] for name in self.names}
        self.shapes: dict[str, list[tuple[int, ...]]] = {name: [] for name in self.names}
        self.keys: list[bytes] = []
        self.lengths: list[int] = []

    def check(self, record: TextRecord) -> None:
        if sorted(record.arrays) != self.names:
            raise ValueError(f"text {record.key}: arrays {sorted(record.arrays)} differ from this cache's {self.names}")
        for name, array in record.arrays.items():
            if _little(array.dtype) != self.dtypes[name] or array.ndim != self.ndims[name]:
                raise ValueError(
                    f"text {record.key}: {name} is {array.ndim}-d {array.dtype}, this cache stores "
                    f"{self.ndims[name]}-d {self.dtypes[name]}"
                )

    def add(self, record: TextRecord, cctx: zstandard.ZstdCompressor) -> int:
        frames = {name: compress(record.arrays[name], cctx) for name in self.names}
        for name, frame in frames.items():
            dataset = self.data[name]
            start = self.ends[name][-1] if self.ends[name] else 0
            end = start + len(frame)
            dataset.resize(end, axis=0)
            dataset[start:end] = np.frombuffer(frame, dtype=np.uint8)
            self.ends[name].append(end)
            self.shapes[name].append(tuple(record.arrays[name].shape))
        self.keys.append(encode_key(record.key))
        self.lengths.append(int(record.length))
        return sum(len(f) for f in frames.values()) + KEY_BYTES + 4 + 16 * len(frames)

    def finish(self) -> None:
        self.group.create_dataset("key", data=np.array(self.keys, dtype=_KEY))
        self.group.create_dataset("length", data=np.array(self.lengths, dtype=np.int32))
        for name in self.names:
            sub = self.group[name]
            sub.create_dataset("end", data=np.array(self.ends[name], dtype=np.int64))
            shapes = np.array(self.shapes[name], dtype=np.int64).reshape(-1, self.ndims[name])
            sub.create_dataset("shape", data=shapes)


class _Shard:
    def __init__(self, path: str, header: str | None) -> None:
        self.path = path
        self.staged = StagedFile(path)
        # a chunk cache that holds the text arrays' current chunks until they are full
        self.file = open_h5(self.staged, "w", rdcc_nbytes=16 * TEXT_CHUNK)
        self.file.attrs["format"] = FORMAT
        self.file.attrs["version"] = VERSION
        if header is not None:
            self.file.attrs[HEADER] = header
        self.latents: dict[tuple[int, ...], _LatentGroup] = {}
        self.text: _TextGroup | None = None
        self.bytes = 0

    def latent_keys(self) -> list[str]:
        return [k.decode() for group in self.latents.values() for k in group.keys]

    def text_keys(self) -> list[str]:
        return [k.decode() for k in self.text.keys] if self.text else []

    def check(self) -> None:
        """Raise the write that failed, if one did (HDF5 never sees it: see stk.shards.staging)."""
        if self.staged.error is not None:
            raise self.staged.error

    def close(self) -> None:
        """Write what is kept until the end, close and fsync; the staging file stays locked."""
        for group in self.latents.values():
            group.finish()
        if self.text is not None:
            self.text.finish()
        self.file.close()
        self.staged.sync()
        self.check()

    def discard(self) -> None:
        """Give up this shard: close what is open and remove its staging file."""
        with contextlib.suppress(Exception):  # the shard is lost either way; the first error is raised
            self.file.close()
        self.staged.discard()


def _check_latent(record: LatentRecord) -> None:
    encode_key(record.key)
    encode_key(record.text_key)
    if record.mean.ndim != 3 or record.mean.dtype.hasobject:
        raise ValueError(f"latent {record.key}: mean must be a numeric (C, h, w) array, got {record.mean.shape}")
    logvar = record.logvar
    if logvar is not None and (logvar.shape, logvar.dtype) != (record.mean.shape, record.mean.dtype):
        raise ValueError(f"latent {record.key}: logvar must have the shape and dtype of mean")
    _pair(record.original_size, "original_size", record.key)
    _pair(record.crop_top_left, "crop_top_left", record.key)


def _check_text(record: TextRecord) -> None:
    encode_key(record.key)
    if not record.arrays:
        raise ValueError(f"text {record.key}: no arrays")
    for name, array in record.arrays.items():
        if not name or "/" in name or name in _RESERVED_TEXT_NAMES or name.startswith("."):
            raise ValueError(f"text {record.key}: {name!r} cannot name an array")
        if array.dtype.hasobject:
            raise ValueError(f"text {record.key}: {name} must be a numeric array")


class ShardWriter:
    """One writer per rank (and per thread: it is not thread-safe), one prefix per writer at a
    time. Starts a new shard when the current one passes `shard_size` bytes of stored records.

    Shard numbers continue after any `<prefix>-<seq>.h5` already in the cache, so a rerun with
    the same prefix never replaces a listed shard; .tmp files in `work_dir` that no live writer
    holds are deleted. If writing to a shard fails, that shard is abandoned (its .tmp file
    removed): `close` raises and nothing is listed. `header` (the manifest's, `Manifest.header()`)
    is stored in every shard, so that a lost manifest can be rebuilt from the shards.
    """

    def __init__(
        self,
        cache: str,
        work_dir: str,
        prefix: str,
        shard_size: int,
        on_shard_done: Callable[[ShardInfo], None],
        header: dict[str, Any] | None = None,
    ) -> None:
        if not prefix or "/" in prefix:
            raise ValueError(f"shard prefix {prefix!r}: must be a non-empty file name")
        if shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.cache, self.work_dir, self.prefix, self.shard_size = cache, work_dir, prefix, shard_size
        self._on_shard_done = on_shard_done
        self._header = None if header is None else json.dumps(header, sort_keys=True)
        self._cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._shard: _Shard | None = None
        self._failed: BaseException | None = None
        os.makedirs(work_dir, exist_ok=True)
        remove_stale(work_dir)
        self._seq = self._next_seq()

    def _next_seq(self) -> int:
        pattern = re.compile(rf"{re.escape(self.prefix)}-(\d+)\.h5")
        shards_dir = storage.join(self.cache, SHARDS_DIR)
        names = os.listdir(self.work_dir)
        if storage.is_s3(self.cache) or os.path.isdir(shards_dir):
            names += [info.key for info in storage.list_files(shards_dir)]
        seqs = [-1] + [int(m.group(1)) for m in map(pattern.fullmatch, names) if m]
        return max(seqs) + 1

    def _current(self) -> _Shard:
        if self._failed is not None:
            raise RuntimeError(f"shard writer {self.prefix} failed earlier: {self._failed}")
        if self._shard is None:
            self._shard = _Shard(
                os.path.join(self.work_dir, f"{self.prefix}-{self._seq:05d}{STAGED_SUFFIX}"), self._header
            )
        return self._shard

    def add_latent(self, record: LatentRecord) -> None:
        _check_latent(record)
        shard = self._current()
        group = shard.latents.get(tuple(record.mean.shape))
        if group is not None:
            group.check(record)
        try:
            if group is None:
                group = shard.latents[tuple(record.mean.shape)] = _LatentGroup(shard.file, record)
            shard.bytes += group.add(record, self._cctx)
            shard.check()
        except BaseException as exc:
            self._abandon(exc)
            raise
        self._roll_over_if_full()

    def add_text(self, record: TextRecord) -> None:
        _check_text(record)
        shard = self._current()
        if shard.text is not None:
            shard.text.check(record)
        try:
            if shard.text is None:
                shard.text = _TextGroup(shard.file, record)
            shard.bytes += shard.text.add(record, self._cctx)
            shard.check()
        except BaseException as exc:
            self._abandon(exc)
            raise
        self._roll_over_if_full()

    def close(self) -> None:
        """Finish the current shard, if it has records."""
        if self._failed is not None:
            raise RuntimeError(f"shard writer {self.prefix} failed: its last shard was abandoned ({self._failed})")
        if self._shard is not None:
            self._finish()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        """Finish the shard, unless writing it is what failed (then the first error is the one raised)."""
        if exc_type is None or self._failed is None:
            self.close()

    def _abandon(self, exc: BaseException) -> None:
        self._failed = exc
        shard, self._shard = self._shard, None
        if shard is not None:
            shard.discard()

    def _roll_over_if_full(self) -> None:
        if self._shard is not None and self._shard.bytes >= self.shard_size:
            self._finish()

    def _finish(self) -> None:
        shard = self._shard
        assert shard is not None
        try:
            shard.close()
            info = ShardInfo(
                name=os.path.basename(shard.path).removesuffix(".tmp"),
                latents=sum(len(g.keys) for g in shard.latents.values()),
                texts=len(shard.text.keys) if shard.text else 0,
                bytes=os.path.getsize(shard.path),
                sha256=file_sha256(shard.path),
                latent_keys=shard.latent_keys(),
                text_keys=shard.text_keys(),
            )
            self._publish(shard.path, info.name)
        except BaseException as exc:
            self._abandon(exc)
            raise
        self._shard = None
        shard.staged.close()
        self._seq += 1
        self._on_shard_done(info)

    def _publish(self, tmp: str, name: str) -> None:
        """The closed shard to CACHE/shards/NAME: a rename when it can be, else a copy or an upload."""
        destination = shard_location(self.cache, name)
        if not storage.is_s3(self.cache):
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            try:
                os.replace(tmp, destination)
                fsync_dir(os.path.dirname(destination))
                return
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
        storage.upload_file(tmp, destination)
        os.unlink(tmp)
