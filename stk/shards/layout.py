"""What is where in a cache and inside a shard, and the codec and checksum both sides use.

A cache (a directory or an s3:// prefix) holds manifest.json and shards/<prefix>-<seq>.h5. A
shard is one HDF5 file, written by one writer (never several: no MPI-enabled HDF5 needed)::

    /                              attrs: format = "stk-shard", version = 1, manifest = the JSON of the
                                   cache manifest's header (all but the shard list: what made the cache),
                                   so that a lost manifest can be rebuilt from the shards (rebuild.py)
    /latents/<C>x<h>x<w>/          one group per latent shape (a bucket); attrs: dtype (numpy str, "<f2")
        mean           (N,C,h,w)   the stored dtype (float16 by default), chunks (1,C,h,w): one chunk per
                                   record, HDF5 filter 32015 (hdf5plugin Zstd, level 5)
        logvar         (N,C,h,w)   same; only when the cache stores the distribution's parameters
        key            (N,)        S64, the latent key (hex, <= 64 ASCII characters)
        text_key       (N,)        S64, the key of the caption's text embedding
        original_size  (N,2) int32 (height, width) after EXIF orientation, before resize
        crop_top_left  (N,2) int32 (top, left) in the resized image
        path           (N,)        variable-length UTF-8 string, the scan table's path
    /text/                         attrs: arrays = the array names
        key            (N,)        S64
        length         (N,) int32  real tokens
        <name>/                    one group per array ("prompt_embeds", "pooled_prompt_embeds"...);
                                   attrs: dtype
            data       (bytes,)    uint8, chunks of 256 KiB, no HDF5 filter: record i's array, C order,
                                   as one zstd frame (level 5), frames back to back
            end        (N,) int64  where record i's frame ends in `data` (it starts where i-1's ends)
            shape      (N,ndim) int64

`mean`/`logvar` chunks are compressed by stk with python-zstandard and written with
write_direct_chunk, and read back with read_direct_chunk: the same bytes HDF5's Zstd filter
writes (a standard zstd frame), so plain h5py + hdf5plugin reads every dataset as usual, while
stk skips HDF5's filter pipeline on both sides (and needs no hdf5plugin). A byte shuffle before zstd was measured and
dropped (bench/RESULTS.md): 0.4% smaller for 14-38% more write time, since zstd codes a 32 KiB
chunk's bytes with one Huffman table, whose size a shuffle barely changes. Level 5, not zstd's
default 3: latents come out the same size at any level (about 0.92 of raw, fp16 mantissas are
noise) for ~20 us more per record, and on text embeddings padded by repeating a row levels 3-4
missed the repeats (0.49 of raw against 0.41 at levels 5-9, measured).

Text arrays vary in shape (captions trimmed to their real tokens), so they are zstd frames in a
flat byte dataset with end offsets, not a variable-length (vlen) dataset: HDF5 reads one vlen
element through its global heap about 8x slower (150 vs 19 us measured for a 45 KB blob).

The variable-length metadata (`key` ... `path`, `end`, `shape`, `length`) is written once when
the shard is closed; the payloads are appended (resize along the first axis) as records come.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from typing import Any, BinaryIO

import h5py
import numpy as np
import zstandard

from stk import storage

__all__ = [
    "FORMAT",
    "HEADER",
    "KEY_BYTES",
    "LATENTS",
    "SHARDS_DIR",
    "TEXT",
    "TEXT_CHUNK",
    "VERSION",
    "ZSTD_FILTER",
    "ZSTD_LEVEL",
    "compress",
    "decompress",
    "encode_key",
    "file_sha256",
    "latent_group",
    "open_h5",
    "shard_key_arrays",
    "shard_keys",
    "shard_location",
]

FORMAT = "stk-shard"
VERSION = 1
HEADER = "manifest"  # the root attribute holding the manifest's header (JSON)
LATENTS = "latents"
TEXT = "text"
KEY_BYTES = 64
ZSTD_LEVEL = 5
# HDF5's registered Zstd filter (hdf5plugin's): named in the datasets so that readers decompress them; stk never
# runs it (it writes and reads the chunks itself), so it writes it without the filter loaded.
ZSTD_FILTER = 32015
TEXT_CHUNK = 256 * 1024
SHARDS_DIR = "shards"
_local = threading.local()


def shard_location(cache: str, name: str) -> str:
    return storage.join(cache, f"{SHARDS_DIR}/{name}")


def open_h5(target: str | BinaryIO | io.RawIOBase, mode: str, **kwargs: Any) -> h5py.File:
    """h5py.File with file locking as HDF5_USE_FILE_LOCKING says, passed explicitly: HDF5 reads
    the variable only once, when h5py is first imported, which may be before stk.shards is."""
    setting = os.environ.get("HDF5_USE_FILE_LOCKING", "FALSE").upper()
    locking: bool | str = setting not in ("FALSE", "0")
    if setting == "BEST_EFFORT":
        locking = "best-effort"
    return h5py.File(target, mode, locking=locking, **kwargs)


def latent_group(shape: tuple[int, ...]) -> str:
    """'latents/4x64x64' for a (C, h, w) latent."""
    return f"{LATENTS}/{'x'.join(str(n) for n in shape)}"


def encode_key(key: str) -> bytes:
    """A key as stored (fixed-length S64); refuses what would be cut or could not be read back."""
    try:
        raw = key.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError(f"key {key!r}: keys must be ASCII (hex)") from None
    if not raw or len(raw) > KEY_BYTES or raw.endswith(b"\0"):
        raise ValueError(f"key {key!r}: keys must be 1 to {KEY_BYTES} characters")
    return raw


def compress(array: np.ndarray, compressor: zstandard.ZstdCompressor) -> bytes:
    """One zstd frame of the array's bytes in C order, little-endian (the frame records its size)."""
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return compressor.compress(little.data.cast("B"))


def decompress(frame: bytes | memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A writable array from one frame (one zstd decompressor per thread: they are not thread-safe)."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    out = np.empty(shape, dtype=dtype)
    with dctx.stream_reader(frame) as reader:
        filled = reader.readinto(out.data.cast("B"))
    if filled != out.nbytes:
        raise ValueError(f"a stored array decompressed to {filled} bytes, expected {out.nbytes} for {shape} {dtype}")
    return out


def file_sha256(path: str) -> str:
    """The hex sha256 of a local file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def shard_key_arrays(file: h5py.File) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """An open shard's keys as stored (bytes arrays): latent keys by group path ('latents/4x64x64'), and text
    keys. Reads only the `key` datasets; refuses a file that is not a shard this stk can read."""
    if file.attrs.get("format") != FORMAT or int(file.attrs.get("version", 0)) > VERSION:
        raise ValueError(f"not a version {VERSION} {FORMAT} file")
    latents = {}
    if LATENTS in file:
        for name, group in file[LATENTS].items():
            latents[f"{LATENTS}/{name}"] = group["key"][()]
    texts = file[TEXT]["key"][()] if TEXT in file else np.zeros(0, f"S{KEY_BYTES}")
    return latents, texts


def shard_keys(file: h5py.File) -> tuple[dict[str, list[str]], list[str]]:
    """shard_key_arrays as strings."""
    latents, texts = shard_key_arrays(file)
    return {path: [k.decode() for k in keys.tolist()] for path, keys in latents.items()}, [
        k.decode() for k in texts.tolist()
    ]
