"""Cache shards: the HDF5 shard writer (stk-cache), the manifest, and the reader (stk-train).

Layout of a cache and of a shard: see layout.py. HDF5's file locking is off unless
HDF5_USE_FILE_LOCKING says otherwise (set to FALSE here when unset, and passed to every file
stk opens, since HDF5 reads the variable only when h5py is first imported): fcntl locks fail
or hang on many NFS and Lustre mounts, and stk never has two writers on one file nor writes a
file that is being read (shards are written under a .tmp name and renamed when closed).
"""

from __future__ import annotations

import os

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from stk.shards.layout import shard_location
from stk.shards.manifest import Manifest
from stk.shards.reader import CacheReader
from stk.shards.records import LatentRecord, TextRecord
from stk.shards.verify import VerifyReport, verify
from stk.shards.writer import ShardInfo, ShardWriter

__all__ = [
    "CacheReader",
    "LatentRecord",
    "Manifest",
    "ShardInfo",
    "ShardWriter",
    "TextRecord",
    "VerifyReport",
    "shard_location",
    "verify",
]
