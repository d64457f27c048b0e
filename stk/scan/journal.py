"""The resume journal: records committed in small atomic chunks while a scan runs.

Each rank writes `OUT/.scan-journal/<run>-r<rank>-<seq>.parquet` every few thousand files. A
rerun after a kill reads every chunk, whatever number of ranks wrote them, and reuses records
whose fingerprint still matches; the journal is deleted once the final table is written.
"""

from __future__ import annotations

import os
import shutil

import pyarrow.parquet as pq

from stk.metadata import write_parquet
from stk.scan.records import Record, records_to_table

__all__ = ["Journal"]

JOURNAL_DIR = ".scan-journal"


class Journal:
    def __init__(self, out_dir: str, run_id: str, rank: int) -> None:
        self.directory = os.path.join(out_dir, JOURNAL_DIR)
        self._prefix = f"{run_id}-r{rank:05d}"
        self._seq = 0

    def commit(self, records: list[Record]) -> None:
        if not records:
            return
        os.makedirs(self.directory, exist_ok=True)
        write_parquet(
            records_to_table(records), os.path.join(self.directory, f"{self._prefix}-{self._seq:06d}.parquet")
        )
        self._seq += 1

    @staticmethod
    def load(out_dir: str) -> list[Record]:
        directory = os.path.join(out_dir, JOURNAL_DIR)
        if not os.path.isdir(directory):
            return []
        records: list[Record] = []
        for name in sorted(os.listdir(directory)):
            if name.endswith(".parquet") and not name.startswith(".tmp-"):
                records.extend(pq.read_table(os.path.join(directory, name)).to_pylist())
        return records

    @staticmethod
    def clear(out_dir: str) -> None:
        shutil.rmtree(os.path.join(out_dir, JOURNAL_DIR), ignore_errors=True)
