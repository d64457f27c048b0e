"""Random access to a cache by key, for any number of reader ranks and threads.

On open, the reader reads every listed shard's `key` datasets (nothing else) and maps each key
to its shard, group and row, as sorted columns (keyindex.py); a key written twice is served from the
first shard in manifest order. A record's other metadata is read whole per group on first use, and
kept (shardmeta.py). Payloads are read chunk by chunk (read_direct_chunk for latents, a byte range for
text) under a lock, and decompressed outside it, so reader threads decompress in parallel.

Local caches are read in place. For an s3:// cache the keys are read with ranged GETs, and a
whole shard is downloaded into `local_dir` the first time a record from it is read, or ahead of
time by `prefetch` (see localcopies.py). Downloads happen outside the lock, so other threads keep
reading the shards they have meanwhile.

No record is served from a shard before the shard's sha256 matched the manifest's (integrity.py):
a local cache's shard is hashed the first time this process reads a record from it, or ahead of
time by `prefetch`, outside the lock; an S3 shard when it is downloaded. A damaged shard raises
CacheIncomplete, then and on every later read of it. `check_sha256=False` skips the hash (the size
is still checked). h5py files stay open per process (at most
`max_open_files`, least recently used closed first) and are reopened after a fork (DataLoader
workers).

Lock order: the reader's lock, then LocalCopies' own (held for bookkeeping only). LocalCopies
calls back into the reader (`_forget`, which takes the reader's lock) without holding its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from stk import storage
from stk.errors import CacheIncomplete, InputError
from stk.shards.integrity import MISSING, damaged, named_damage, problem
from stk.shards.keyindex import KeyIndex
from stk.shards.layout import TEXT, decompress, open_h5, shard_key_arrays, shard_location
from stk.shards.localcopies import TRIES, LocalCopies
from stk.shards.manifest import Manifest
from stk.shards.records import LatentRecord, TextRecord
from stk.shards.shardmeta import Group, LatentMeta, OpenShard, TextMeta

__all__ = ["CacheReader"]


class CacheReader:
    """Read a cache written by stk-cache. Thread-safe; open one per process."""

    def __init__(
        self,
        cache: str,
        local_dir: str | None = None,
        max_local_bytes: int | None = None,
        max_open_files: int = 128,
        check_sha256: bool = True,
    ) -> None:
        manifest = Manifest.load(cache)
        if manifest is None:
            raise InputError(f"{cache}: no manifest.json (not a cache, or stk-cache has not finished a shard yet)")
        self.cache = cache
        self.manifest = manifest
        self._max_open = max(max_open_files, 1)
        self._copies = LocalCopies(local_dir, max_local_bytes, check_sha256) if storage.is_s3(cache) else None
        self._check_sha256 = check_sha256
        self._checked: set[int] = set()  # shards whose bytes matched the manifest (local caches)
        self._checking = [threading.Lock() for _ in manifest.shards]  # one hash per shard at a time
        self._damaged: dict[int, CacheIncomplete] = {}
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._open: OrderedDict[int, OpenShard] = OrderedDict()
        self._groups: list[Group] = []
        self._latents = KeyIndex()  # key -> (group, row)
        self._texts = KeyIndex()
        try:
            for shard in range(len(manifest.shards)):
                self._index(shard)
            self._latents.freeze()
            self._texts.freeze()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- public

    def latent(self, key: str) -> LatentRecord:
        group_id, row = self._latent_at(key)
        group = self._groups[group_id]
        self._fetch(group.shard)
        with self._named_damage(group.shard):
            with self._locked():
                opened = self._opened(group.shard)
                meta = self._latent_meta(group, opened)
                chunks = []
                for name in meta.payloads:
                    dataset = opened.dataset(f"{group.path}/{name}")
                    mask, frame = dataset.id.read_direct_chunk((row,) + (0,) * len(group.shape))
                    chunks.append(dataset[row] if mask else frame)  # a filter was skipped: let HDF5 decode it
            arrays = [c if isinstance(c, np.ndarray) else decompress(c, meta.dtype, group.shape) for c in chunks]
        return LatentRecord(
            key=key,
            text_key=str(meta.text_key[row]),
            mean=arrays[0],
            logvar=arrays[1] if len(arrays) > 1 else None,
            original_size=(int(meta.original_size[row, 0]), int(meta.original_size[row, 1])),
            crop_top_left=(int(meta.crop_top_left[row, 0]), int(meta.crop_top_left[row, 1])),
            path=str(meta.path[row]),
        )

    def text(self, key: str) -> TextRecord:
        found = self._texts.find(key)
        if found is None:
            raise KeyError(f"text embedding {key} is not in the cache {self.cache}")
        group_id, row = found
        group = self._groups[group_id]
        self._fetch(group.shard)
        with self._named_damage(group.shard):
            with self._locked():
                opened = self._opened(group.shard)
                if group.text_meta is None:
                    group.text_meta = TextMeta.read(opened.file[TEXT])
                meta = group.text_meta
                frames = {}
                for name, array in meta.arrays.items():
                    start = int(array.end[row - 1]) if row else 0
                    frames[name] = opened.dataset(f"{TEXT}/{name}/data")[start : int(array.end[row])].data
            arrays = {
                name: decompress(frame, meta.arrays[name].dtype, tuple(meta.arrays[name].shape[row].tolist()))
                for name, frame in frames.items()
            }
        return TextRecord(key=key, arrays=arrays, length=int(meta.length[row]))

    def text_key(self, key: str) -> str:
        """The key of a latent's caption embedding, from its shard's metadata (the latent is not read)."""
        group_id, row = self._latent_at(key)
        group = self._groups[group_id]
        if group.latent_meta is None:
            self._fetch(group.shard)
            with self._locked():
                self._latent_meta(group, self._opened(group.shard))
        assert group.latent_meta is not None
        return str(group.latent_meta.text_key[row])

    def prefetch(self, keys: Iterable[str]) -> None:
        """Download (S3) or check (a local cache's sha256) the shards holding these keys (latent or
        text keys) that are not ready yet, in the order the keys first need them. No lock is held
        meanwhile, so other threads keep reading. Each S3 shard counts as used now for the
        `max_local_bytes` limit: prefetch no more than the limit holds beside the shards being read."""
        if self._copies is None and not self._check_sha256:
            return
        shards: dict[int, None] = {}  # an ordered set
        for key in keys:
            found = self._latents.find(key) or self._texts.find(key)
            if found is None:
                raise KeyError(f"{key} is neither a latent nor a text embedding in the cache {self.cache}")
            shards.setdefault(self._groups[found[0]].shard, None)
        for shard in shards:
            self._fetch(shard)

    def latent_keys(self) -> list[str]:
        return self._latents.strings()

    def text_keys(self) -> list[str]:
        return self._texts.strings()

    def latent_key_array(self) -> np.ndarray:
        """The latent keys, sorted, as a read-only bytes array (what stays compact at 100M samples)."""
        return self._latents.keys

    def text_key_array(self) -> np.ndarray:
        """The text keys, as latent_key_array."""
        return self._texts.keys

    def bucket_rows(self) -> dict[tuple[int, int], np.ndarray]:
        """Latent (h, w) -> where its keys are in latent_key_array (ascending: sorted keys), shapes sorted."""
        shapes = sorted({(g.shape[1], g.shape[2]) for g in self._groups if g.path != TEXT})
        shape_of_group = np.array(
            [shapes.index((g.shape[1], g.shape[2])) if g.path != TEXT else -1 for g in self._groups]
        )
        shape_of_key = shape_of_group[self._latents.group] if len(self._latents) else np.zeros(0, np.int64)
        order = np.argsort(shape_of_key, kind="stable")
        bounds = np.searchsorted(shape_of_key[order], np.arange(len(shapes) + 1))
        return {hw: order[bounds[i] : bounds[i + 1]] for i, hw in enumerate(shapes) if bounds[i + 1] > bounds[i]}

    def bucket_keys(self) -> dict[tuple[int, int], np.ndarray]:
        """Latent (h, w) -> its keys as a bytes array, both sorted: the same on every rank."""
        return {hw: self._latents.keys[rows] for hw, rows in self.bucket_rows().items()}

    def buckets(self) -> dict[tuple[int, int], list[str]]:
        """bucket_keys as strings."""
        return {hw: [k.decode() for k in keys.tolist()] for hw, keys in self.bucket_keys().items()}

    def close(self) -> None:
        with self._locked():
            for opened in self._open.values():
                opened.file.close()
            self._open.clear()
            if self._copies is not None:
                self._copies.close()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- index

    def _index(self, shard: int) -> None:
        entry = self.manifest.shards[shard]
        location = shard_location(self.cache, str(entry["name"]))
        local = self._copies.present(entry) if self._copies is not None else location
        why = problem(location, entry, sha256=False) if self._copies is None else None  # missing, or cut short
        if why is not None:
            raise damaged(location, why)
        try:
            if local is not None:
                latents, texts = shard_key_arrays(self._opened(shard).file)
            else:  # S3, not fetched yet: the keys alone, by ranged GETs
                with storage.open_read(location, int(entry["bytes"])) as raw, open_h5(raw, "r") as file:
                    latents, texts = shard_key_arrays(file)
        except FileNotFoundError:
            raise damaged(location, MISSING) from None
        except (OSError, ValueError, KeyError) as exc:
            raise damaged(location, f"unreadable: {exc}") from None
        for path, keys in latents.items():
            group_id = len(self._groups)
            self._groups.append(Group(shard, path, tuple(int(n) for n in path.rsplit("/", 1)[1].split("x"))))
            self._latents.add(keys, group_id)
        if len(texts):
            group_id = len(self._groups)
            self._groups.append(Group(shard, TEXT))
            self._texts.add(texts, group_id)

    def _latent_at(self, key: str) -> tuple[int, int]:
        found = self._latents.find(key)
        if found is None:
            raise KeyError(f"latent {key} is not in the cache {self.cache}")
        return found

    # ---------------------------------------------------------------- files

    def _locked(self) -> threading.RLock:
        """The lock, after forgetting (not closing) files a parent process opened before a fork."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._lock = threading.RLock()
            self._checking = [threading.Lock() for _ in self.manifest.shards]
            self._open = OrderedDict()
        return self._lock

    def _fetch(self, shard: int) -> None:
        """Before taking the lock: a local cache's shard is checked here on first use; an S3 shard
        that is not open gets its local copy here, so that its download does not hold up the other
        threads (`_opened` fetches it again under the lock only if it was evicted in between); one
        that is open counts as used, for the LRU limit."""
        self._locked()
        if self._copies is None:
            self._check(shard)
        elif shard in self._open:
            self._copies.touch(self.manifest.shards[shard])
        else:
            self._local_copy(shard)

    def _check(self, shard: int) -> None:
        """A local cache's shard against the manifest's sha256, once per process."""
        if not self._check_sha256 or shard in self._checked:
            return
        with self._checking[shard]:
            if shard in self._damaged:
                raise self._damaged[shard]
            if shard in self._checked:
                return
            entry = self.manifest.shards[shard]
            location = shard_location(self.cache, str(entry["name"]))
            why = problem(location, entry)
            if why is not None:
                self._damaged[shard] = damaged(location, why)
                raise self._damaged[shard]
            self._checked.add(shard)

    def _named_damage(self, shard: int) -> contextlib.AbstractContextManager[None]:
        """Reads of a checked shard that fail anyway: integrity.named_damage, with the file they read."""
        entry = self.manifest.shards[shard]
        location = shard_location(self.cache, str(entry["name"]))
        return named_damage(self._copies.path(entry) if self._copies is not None else location, location, entry)

    def _local_copy(self, shard: int) -> str:
        assert self._copies is not None
        if shard in self._damaged:
            raise self._damaged[shard]
        entry = self.manifest.shards[shard]
        try:
            return self._copies.get(shard_location(self.cache, str(entry["name"])), entry, self._forget)
        except CacheIncomplete as exc:  # damaged: not downloaded again for every record
            self._damaged[shard] = exc
            raise

    @staticmethod
    def _latent_meta(group: Group, opened: OpenShard) -> LatentMeta:
        if group.latent_meta is None:
            group.latent_meta = LatentMeta.read(opened.file[group.path])
        return group.latent_meta

    def _opened(self, shard: int) -> OpenShard:
        found = self._open.get(shard)
        if found is not None:
            self._open.move_to_end(shard)
            return found
        if self._copies is None:
            opened = OpenShard(shard_location(self.cache, str(self.manifest.shards[shard]["name"])))
        else:
            opened = self._open_copy(shard)
        self._open[shard] = opened
        while len(self._open) > self._max_open:
            _, oldest = self._open.popitem(last=False)
            oldest.file.close()
        return opened

    def _open_copy(self, shard: int) -> OpenShard:
        """The local copy of an S3 shard, opened. The copy this process holds is deleted by no other
        process, but another thread of this one may give it up between fetch and open (a limit
        below two shards): then it is fetched again."""
        for _ in range(TRIES - 1):
            with contextlib.suppress(FileNotFoundError):
                return OpenShard(self._local_copy(shard))
        return OpenShard(self._local_copy(shard))  # the last try raises

    def _forget(self, path: str) -> None:
        """Close the shard whose local copy is about to be deleted (LocalCopies calls this without its
        own lock held, from any thread)."""
        assert self._copies is not None
        with self._locked():
            for shard, opened in list(self._open.items()):
                if self._copies.path(self.manifest.shards[shard]) == path:
                    opened.file.close()
                    del self._open[shard]
