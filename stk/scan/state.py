"""What a scan remembers between runs, so that a rerun redoes nothing that is still valid.

- The state table `OUT/.scan-state.parquet`: every record of the last finished scan, good,
  filtered and failed alike (metadata.parquet holds only the images that are kept).
- The journal `OUT/.scan-journal/<run>-r<rank>-<seq>.parquet`: records committed in small
  atomic chunks while a scan runs. A rerun after a kill reads every chunk, whatever number of
  ranks wrote them; the journal is deleted once the state table is written.

Both carry the probe settings that produced them: records made under other settings (another
--max-pixels, another --missing-caption) are not reused.
"""

from __future__ import annotations

import io
import os
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stk import storage
from stk.scan.parts import stream_parquet
from stk.scan.records import RECORD_SCHEMA, last_per_path

__all__ = ["TRANSIENT_KINDS", "Journal", "clear_previous", "load_previous", "save_state"]

JOURNAL_DIR = ".scan-journal"
STATE_FILE = ".scan-state.parquet"
_SETTINGS_KEY = b"stk.probe_settings"

# Failures that may go away without the file changing: always looked at again.
TRANSIENT_KINDS = frozenset({"unreadable", "not_found", "out_of_memory"})


def _with_settings(schema: pa.Schema, settings: str) -> pa.Schema:
    return schema.with_metadata({_SETTINGS_KEY: settings.encode()})


def _write(records: pa.Table, location: str, settings: str) -> None:
    buffer = io.BytesIO()
    pq.write_table(records.replace_schema_metadata({_SETTINGS_KEY: settings.encode()}), buffer, compression="zstd")
    storage.write_atomic(location, buffer.getvalue())


def _read(location: str, settings: str) -> pa.Table | None:
    """The file's records, or none if it was made under other settings or cannot be read."""
    try:
        table = pq.read_table(location)
    except (OSError, pa.ArrowException):
        return None  # a damaged state file only costs a rescan
    metadata = table.schema.metadata or {}
    if metadata.get(_SETTINGS_KEY, b"").decode() != settings or table.schema.names != RECORD_SCHEMA.names:
        return None
    transient = pc.fill_null(pc.is_in(table.column("kind"), value_set=pa.array(sorted(TRANSIENT_KINDS))), False)
    if pc.any(transient).as_py():
        table = table.filter(pc.invert(transient))
    return table.cast(RECORD_SCHEMA)


class Journal:
    """One rank's commits during one run."""

    def __init__(self, out_dir: str, run_id: str, rank: int, settings: str) -> None:
        self.directory = os.path.join(out_dir, JOURNAL_DIR)
        self._prefix = f"{run_id}-r{rank:05d}"
        self._settings = settings
        self._seq = 0

    def commit(self, records: pa.Table) -> None:
        if not records.num_rows:
            return
        os.makedirs(self.directory, exist_ok=True)
        _write(records, os.path.join(self.directory, f"{self._prefix}-{self._seq:06d}.parquet"), self._settings)
        self._seq += 1


def load_previous(out_dir: str, settings: str) -> pa.Table:
    """Records of the last finished scan, then of the journal: one per path (a later one wins),
    sorted by path."""
    tables = []
    state = os.path.join(out_dir, STATE_FILE)
    if os.path.exists(state):
        tables.append(_read(state, settings))
    directory = os.path.join(out_dir, JOURNAL_DIR)
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.endswith(".parquet") and not name.startswith(".tmp-"):
                tables.append(_read(os.path.join(directory, name), settings))
    found = [t for t in tables if t is not None]
    return last_per_path(pa.concat_tables(found) if found else RECORD_SCHEMA.empty_table())


def save_state(out_dir: str, parts: list[str], settings: str) -> None:
    """Record the finished scan (the ranks' parts, in path order), then drop the journal it supersedes."""
    stream_parquet(parts, os.path.join(out_dir, STATE_FILE), _with_settings(RECORD_SCHEMA, settings))
    shutil.rmtree(os.path.join(out_dir, JOURNAL_DIR), ignore_errors=True)


def clear_previous(out_dir: str) -> None:
    shutil.rmtree(os.path.join(out_dir, JOURNAL_DIR), ignore_errors=True)
    state = os.path.join(out_dir, STATE_FILE)
    if os.path.exists(state):
        os.unlink(state)
