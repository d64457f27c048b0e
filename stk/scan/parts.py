"""Each rank's part of the scan's outputs, and the parts streamed into one file on rank 0.

A rank writes the rows, errors and state records of its own range of paths to
`OUT/.scan-parts/<run>-r<rank>-<name>.parquet`; the ranges are in path order, so the final
files are the parts one after the other, copied a row group at a time: no rank ever holds the
whole table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from stk.metadata import to_json_lines
from stk.storage.failures import storage_errors
from stk.storage.modes import honour_umask

__all__ = ["PARTS_DIR", "PartWriter", "atomic_file", "clear_parts", "stream_jsonl", "stream_parquet"]

PARTS_DIR = ".scan-parts"


class PartWriter:
    """One rank's part files, one per output name; a name never written has no file."""

    def __init__(self, out_dir: str, run_id: str, rank: int) -> None:
        self._prefix = os.path.join(out_dir, PARTS_DIR, f"{run_id}-r{rank:05d}")
        self._writers: dict[str, pq.ParquetWriter] = {}

    def write(self, name: str, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        with storage_errors(self._file(name), saving=True):  # pyarrow's errors name no file
            if name not in self._writers:
                os.makedirs(os.path.dirname(self._prefix), exist_ok=True)
                self._writers[name] = pq.ParquetWriter(self._file(name), table.schema, compression="zstd")
            self._writers[name].write_table(table)

    def close(self) -> dict[str, str]:
        """{name: the part's file}, closed and on disk."""
        for name, writer in self._writers.items():
            with storage_errors(self._file(name), saving=True):
                writer.close()
        return {name: self._file(name) for name in self._writers}

    def _file(self, name: str) -> str:
        return f"{self._prefix}-{name}.parquet"


def _batches(parts: list[str]) -> Iterator[pa.RecordBatch]:
    for part in parts:
        yield from pq.ParquetFile(part).iter_batches(batch_size=65_536)


@contextlib.contextmanager
def atomic_file(location: str) -> Iterator[str]:
    """A temporary name next to `location`, renamed over it once the block succeeds: readers see
    the old file or the new one, never a part."""
    with storage_errors(location, saving=True):  # pyarrow's errors name no file: name the one being written
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(location) or ".")
        honour_umask(fd)  # mkstemp makes 0600, and the writer that reopens it keeps that
        os.close(fd)
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, location)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def stream_parquet(parts: list[str], location: str, schema: pa.Schema) -> None:
    """The parts, in order, as one parquet file with `schema` (and its metadata)."""
    with atomic_file(location) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for batch in _batches(parts):
            writer.write_batch(batch)


def stream_jsonl(parts: list[str], location: str) -> None:
    """The parts' rows, in order, as JSON lines."""
    with atomic_file(location) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for batch in _batches(parts):
            out.write(to_json_lines(batch.to_pylist()))


def clear_parts(out_dir: str) -> None:
    shutil.rmtree(os.path.join(out_dir, PARTS_DIR), ignore_errors=True)
