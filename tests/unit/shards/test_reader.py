"""stk.shards' reader: threads and forked processes read the same shards, with HDF5 file locking off."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
from support.shard_records import SHAPES, assert_same_latent, make_latent, write

from stk.errors import CacheIncomplete
from stk.shards import (
    CacheReader,
    TextRecord,
    shard_location,
)


def test_reader_threads_and_forked_processes(cache: str) -> None:
    latents = [make_latent(i, SHAPES[i % 3]) for i in range(60)]
    write(cache, latents, shard_size=8000)
    reader = CacheReader(cache, max_open_files=2)  # files closed and reopened as threads go round
    failures: list[BaseException] = []

    def read_all(offset: int) -> None:
        try:
            for sample in latents[offset:] + latents[:offset]:
                assert_same_latent(reader.latent(sample.key), sample)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=read_all, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]

    queue = multiprocessing.get_context("fork").SimpleQueue()

    def child() -> None:  # inherits the reader with files open, as a DataLoader worker does
        queue.put(sum(float(reader.latent(s.key).mean.astype(np.float64).sum()) for s in latents))

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert queue.get() == pytest.approx(sum(float(s.mean.astype(np.float64).sum()) for s in latents))
    reader.close()


def test_file_locking_is_off_even_when_h5py_was_imported_first(cache: str) -> None:
    """HDF5 reads HDF5_USE_FILE_LOCKING once, at h5py's import: stk passes it to every open."""
    rank0 = write(cache, [make_latent(0)])
    holder = h5py.File(shard_location(cache, rank0.infos[0].name), "r+", locking=True)  # an exclusive lock
    try:
        code = "import sys, h5py\nfrom stk.shards import CacheReader\nprint(CacheReader(sys.argv[1]).latent_keys())"
        env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
        proc = subprocess.run([sys.executable, "-c", code, cache], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        assert make_latent(0).key in proc.stdout
    finally:
        holder.close()


@pytest.mark.parametrize("cut", [4096, 16000])  # bytes kept of ~290 KB, data in the first ~30 KB
def test_a_shard_cut_short_while_it_is_read_is_named_with_its_fix(cache: str, cut: int) -> None:
    """A shard checked at its first read, then truncated under the job: stk-train died 8 steps later with zstd's
    ZstdError traceback (exit 1; a text read: KeyError). Now each later read is the damaged shard's one line, as at
    the start (exit 6)."""
    latents = [make_latent(i) for i in range(12)]
    texts = [TextRecord(f"{i:064x}", {"hidden": np.full((5, 8), i, np.float16)}, 5) for i in range(3)]
    rank0 = write(cache, latents, texts, shard_size=10**9)
    location = shard_location(cache, rank0.infos[0].name)
    with CacheReader(cache) as reader:
        assert_same_latent(reader.latent(latents[0].key), latents[0])  # checked and open
        os.truncate(location, cut)
        fix = f"run `stk-cache verify {cache} --repair`"
        for read in (lambda: reader.latent(latents[-1].key), lambda: reader.text(texts[-1].key)):
            with pytest.raises(CacheIncomplete, match=rf"shard {location} is damaged \(\d+ bytes, .*\): {fix}"):
                read()
