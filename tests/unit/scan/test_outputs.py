"""Unit tests for the pure parts of a scan: assemble() and the outputs, split_by_bytes, a rank's Block and
parse_max_errors (stk.scan.outputs, stk.scan.pipeline and stk.errors)."""

from __future__ import annotations

import json
import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stk.buckets import BatchCheck, Bucket, BucketIndex, BucketSpec, check_batches, make_buckets
from stk.errors import InputError, parse_max_errors
from stk.scan.outputs import (
    BUCKETS,
    ERRORS,
    METADATA,
    SUMMARY,
    Filters,
    Tally,
    assemble,
    buckets_document,
    write_outputs,
    write_part,
)
from stk.scan.parts import PartWriter
from stk.scan.pipeline import Block, split_by_bytes
from stk.scan.records import RECORD_SCHEMA, Record, error_record, records_to_table

BUCKETS_256 = make_buckets(BucketSpec(256, alignment=64))  # 256 short edge: 256x512 .. 512x256, 9 buckets
FILTERS = Filters(min_size=50, min_aspect=0.5, max_aspect=2.0)


def image(path: str, width: int, height: int, **extra: Any) -> Record:
    """A record as stk.scan.probe makes it for a good image."""
    record: Record = {
        "path": path,
        "location": f"/data/{path}",
        "width": width,
        "height": height,
        "format": "JPEG",
        "bytes": width * height // 10,
        "mtime": 1_700_000_000.5,
        "etag": None,
        "caption": f"caption of {path}",
        "caption_source": "sidecar",
        "fingerprint": f"fp-{path}",
        "kind": None,
        "reason": None,
        "warning_kind": None,
        "warning": None,
    }
    record.update(extra)
    assert set(record) == set(RECORD_SCHEMA.names)
    return record


def error(path: str, kind: str, reason: str = "") -> Record:
    return error_record(path, f"/data/{path}", f"fp-{path}", kind, reason or f"{kind} reason")


def bucket_of(width: int, height: int) -> Bucket:
    return next(b for b in BUCKETS_256 if (b.width, b.height) == (width, height))


@dataclass
class Outcome:
    """assemble()'s result as Python rows, with the batch check of its counts."""

    rows: list[Record]
    errors: list[Record]
    tally: Tally
    check: BatchCheck

    def __getattr__(self, name: str) -> Any:  # counts, error_kinds, faults, ...: the tally's
        return getattr(self.tally, name)


def assembled(records: list[Record], buckets: list[Bucket], filters: Filters, effective: int, repeats: int) -> Outcome:
    out = assemble(records_to_table(records), BucketIndex(buckets), filters)
    check = check_batches(out.tally.counts, buckets, effective, repeats)
    return Outcome(out.rows.to_pylist(), out.errors.to_pylist(), out.tally, check)


# --- assemble ---------------------------------------------------------------------------------------


def test_rows_are_sorted_by_path_and_get_buckets() -> None:
    records = [image("z/last.jpg", 300, 300), image("a/first.jpg", 600, 300), image("m/mid.jpg", 300, 600)]
    out = assembled(records, BUCKETS_256, FILTERS, effective=1, repeats=1)
    assert [r["path"] for r in out.rows] == ["a/first.jpg", "m/mid.jpg", "z/last.jpg"]
    wide, tall, square = bucket_of(512, 256), bucket_of(256, 512), bucket_of(256, 256)
    assert [(r["bucket"], r["bucket_width"], r["bucket_height"]) for r in out.rows] == [
        (wide.id, 512, 256),
        (tall.id, 256, 512),
        (square.id, 256, 256),
    ]
    assert [r["filename"] for r in out.rows] == [r["path"] for r in out.rows]
    assert out.counts == {wide.id: 1, tall.id: 1, square.id: 1}
    assert out.errors == [] and out.error_kinds == {} and out.faults == 0 and out.skipped == 0


def test_rows_keep_the_probe_fields() -> None:
    rec = image("a.jpg", 640, 480, etag="abc", caption="a cat")
    (row,) = assembled([rec], BUCKETS_256, FILTERS, 1, 1).rows
    for key, value in rec.items():
        assert row[key] == value, key


def test_duplicate_path_keeps_the_later_record() -> None:
    records = [
        image("b.jpg", 100, 100),
        error("c.jpg", "corrupt"),
        image("a.jpg", 100, 100, caption="old"),
        image("a.jpg", 200, 100, caption="new"),
        image("c.jpg", 120, 100),  # fixed since: the later, good record wins
        error("b.jpg", "truncated"),  # broken since: the later error wins
    ]
    out = assembled(records, BUCKETS_256, FILTERS, 1, 1)
    assert [(r["path"], r["caption"], r["width"]) for r in out.rows] == [
        ("a.jpg", "new", 200),
        ("c.jpg", "caption of c.jpg", 120),
    ]
    assert out.errors == [
        {
            "path": "b.jpg",
            "location": "/data/b.jpg",
            "kind": "truncated",
            "reason": "truncated reason",
            "severity": "error",
        }
    ]
    assert out.error_kinds == {"truncated": 1}
    assert out.faults == 1


def test_relisted_duplicates_are_reported_without_replacing_the_image() -> None:
    records = [image("a.jpg", 100, 100), error("a.jpg", "duplicate", "listed more than once")]
    out = assembled(records, BUCKETS_256, FILTERS, 1, 1)
    assert [r["path"] for r in out.rows] == ["a.jpg"]
    assert [(e["path"], e["kind"]) for e in out.errors] == [("a.jpg", "duplicate")]
    assert out.faults == 1


def test_filtered_images_are_skipped_not_faults() -> None:
    records = [
        image("small.jpg", 40, 400),  # shorter side 40 < 50
        image("wide.jpg", 300, 100),  # aspect 3
        image("tall.jpg", 100, 201),  # aspect 0.4975
        image("edge-wide.jpg", 200, 100),  # aspect exactly 2: kept
        image("edge-small.jpg", 50, 50),  # exactly the minimum: kept
        error("bad.jpg", "corrupt"),
        error("text.jpg", "not_image"),
        error("gone.jpg", "not_found"),
    ]
    out = assembled(records, BUCKETS_256, FILTERS, 1, 1)
    assert [r["path"] for r in out.rows] == ["edge-small.jpg", "edge-wide.jpg"]
    by_path = {e["path"]: e for e in out.errors}
    assert by_path["small.jpg"]["kind"] == "too_small"
    assert "--min-size 50" in by_path["small.jpg"]["reason"]
    assert by_path["wide.jpg"]["kind"] == "aspect_out_of_range"
    assert by_path["tall.jpg"]["kind"] == "aspect_out_of_range"
    assert "100x201" in by_path["tall.jpg"]["reason"]
    assert out.error_kinds == {"aspect_out_of_range": 2, "corrupt": 1, "not_found": 1, "not_image": 1, "too_small": 1}
    assert list(out.error_kinds) == sorted(out.error_kinds)
    assert out.skipped == 3
    assert out.faults == 3
    assert [e["path"] for e in out.errors] == sorted(e["path"] for e in out.errors)
    assert all(set(e) == {"path", "location", "kind", "reason", "severity"} for e in out.errors)
    assert {e["severity"] for e in out.errors} == {"error"}  # filtered out or bad: not in the table


def test_damaged_metadata_keeps_the_image_and_adds_a_warning_row() -> None:
    records = [
        image("a.jpg", 300, 300, warning_kind="exif_unreadable", warning="unreadable EXIF block (x)"),
        error("b.jpg", "corrupt"),
        image("c.jpg", 10, 300, warning_kind="exif_unreadable", warning="unreadable EXIF block (y)"),  # filtered
    ]
    out = assembled(records, BUCKETS_256, Filters(min_size=50), 1, 1)
    assert [r["path"] for r in out.rows] == ["a.jpg"]
    assert [(e["path"], e["kind"], e["severity"]) for e in out.errors] == [
        ("a.jpg", "exif_unreadable", "warning"),
        ("b.jpg", "corrupt", "error"),
        ("c.jpg", "too_small", "error"),
    ]
    assert out.warning_kinds == {"exif_unreadable": 1} and out.warnings == 1
    assert out.fault_kinds == {"corrupt": 1}  # what --max-errors counts: not the warning


def test_assemble_does_not_change_its_input() -> None:
    records = [image("wide.jpg", 300, 100), image("ok.jpg", 100, 100)]
    before = [dict(r) for r in records]
    assembled(records, BUCKETS_256, FILTERS, 1, 1)
    assert records == before


def test_assemble_does_not_depend_on_the_order_of_ranks() -> None:
    rng = random.Random(5)
    records = [image(f"d{i % 3}/img{i:03d}.jpg", rng.randrange(40, 700), rng.randrange(40, 700)) for i in range(60)]
    records += [error(f"d9/bad{i}.jpg", "corrupt") for i in range(5)]
    first = assembled(records, BUCKETS_256, FILTERS, 4, 1)
    rng.shuffle(records)
    second = assembled(records, BUCKETS_256, FILTERS, 4, 1)
    assert first.rows == second.rows
    assert first.errors == second.errors
    assert first.counts == second.counts
    assert first.check == second.check


def test_ranges_of_paths_assembled_apart_make_the_whole() -> None:
    """What lets every rank write its own part: the parts, one after the other, are the whole."""
    rng = random.Random(7)
    records = [image(f"d{i % 4}/img{i:03d}.jpg", rng.randrange(40, 700), rng.randrange(40, 700)) for i in range(80)]
    records += [error(f"d1/img{i:03d}.jpg", "duplicate") for i in range(0, 80, 9)]
    records += [
        image("d2/img002.jpg", 300, 300, warning_kind="exif_unreadable", warning="w"),
        error("d3/x.jpg", "corrupt"),
    ]
    index = BucketIndex(BUCKETS_256)
    whole = assemble(records_to_table(records), index, FILTERS)
    cuts = ["d1/img030.jpg", "d2/", "d2/img050.jpg"]
    ranges = zip(["", *cuts], [*cuts, "~"], strict=True)
    parts = [
        assemble(records_to_table([r for r in records if lo <= r["path"] < hi]), index, FILTERS) for lo, hi in ranges
    ]
    for name in ("rows", "errors", "latest"):
        assert pa.concat_tables([getattr(part, name) for part in parts]).equals(getattr(whole, name)), name
    tally = Tally()
    for part in parts:
        tally = tally.plus(part.tally)
    assert tally == whole.tally


def test_assemble_runs_the_batch_check() -> None:
    records = [image(f"sq{i}.jpg", 300, 300) for i in range(5)] + [image("wide.jpg", 500, 260)]
    out = assembled(records, BUCKETS_256, FILTERS, effective=4, repeats=1)
    square, wide = bucket_of(256, 256), bucket_of(512, 256)
    assert out.counts == {square.id: 5, wide.id: 1}
    assert (out.check.effective_batch_size, out.check.repeats) == (4, 1)
    assert [(s.bucket.id, s.count, s.min_repeats) for s in out.check.short] == [(wide.id, 1, 4)]
    assert assembled(records, BUCKETS_256, FILTERS, effective=4, repeats=4).check.ok


def test_buckets_document() -> None:
    records = [image(f"sq{i}.jpg", 300, 300) for i in range(5)] + [image("wide.jpg", 500, 260)]
    out = assembled(records, BUCKETS_256, FILTERS, effective=4, repeats=1)
    square, wide = bucket_of(256, 256), bucket_of(512, 256)
    strict = buckets_document(out.tally, out.check, BUCKETS_256, {"batch_size": 4}, oversubscribe=False)
    assert strict["batch_size"] == 4
    assert (strict["effective_batch_size"], strict["oversubscribed"], strict["batch_check_ok"]) == (4, False, False)
    assert [b["id"] for b in strict["buckets"]] == [b.id for b in BUCKETS_256]
    entries = {b["id"]: b for b in strict["buckets"]}
    assert entries[square.id] == {"id": square.id, "width": 256, "height": 256, "count": 5, "repeats": 1}
    assert entries[wide.id]["repeats"] == 1
    assert strict["short_buckets"] == [{"id": wide.id, "count": 1, "samples": 1, "min_repeats": 4}]
    loose = buckets_document(out.tally, out.check, BUCKETS_256, {}, oversubscribe=True)
    assert (loose["oversubscribed"], loose["batch_check_ok"]) == (True, True)
    assert {b["id"]: b["repeats"] for b in loose["buckets"]}[wide.id] == 4
    assert {b["id"]: b["repeats"] for b in loose["buckets"]}[square.id] == 1


def test_write_outputs(tmp_path: Path) -> None:
    records = [image("b.jpg", 300, 300), image("a.jpg", 500, 260), error("c.jpg", "corrupt")]
    out = assemble(records_to_table(records), BucketIndex(BUCKETS_256), FILTERS)
    doc = buckets_document(out.tally, check_batches(out.tally.counts, BUCKETS_256, 1, 1), BUCKETS_256, {}, False)
    writer = PartWriter(str(tmp_path / "parts"), "run", 0)
    write_part(writer, out)
    parts = {name: [part] for name, part in writer.close().items()}
    write_outputs(str(tmp_path), parts, doc, {"files": 3})
    assert sorted(os.listdir(tmp_path)) == sorted([METADATA, BUCKETS, ERRORS, SUMMARY, "parts"])
    table = pq.read_table(tmp_path / METADATA)
    assert table.column("path").to_pylist() == ["a.jpg", "b.jpg"]
    assert table.column("filename").to_pylist() == ["a.jpg", "b.jpg"]
    assert table.column("bucket").to_pylist() == [bucket_of(512, 256).id, bucket_of(256, 256).id]
    assert "kind" not in table.column_names
    errors = [json.loads(line) for line in (tmp_path / ERRORS).read_text().splitlines()]
    assert errors == [
        {"path": "c.jpg", "location": "/data/c.jpg", "kind": "corrupt", "reason": "corrupt reason", "severity": "error"}
    ]
    assert json.loads((tmp_path / BUCKETS).read_text()) == doc
    assert json.loads((tmp_path / SUMMARY).read_text()) == {"files": 3}


# --- split_by_bytes -------------------------------------------------------------------------------


def candidates(sizes: list[int]) -> list[tuple[str, int]]:
    return [(f"img{i:04d}.jpg", s) for i, s in enumerate(sizes)]


def split(items: list[tuple[str, int]], parts: int, joined: list[bool] | None = None) -> list[list[tuple[str, int]]]:
    weights = np.array([size for _, size in items], np.int64)
    runs = split_by_bytes(weights, parts, None if joined is None else np.array(joined))
    return [[items[i] for i in run] for run in runs]


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 16])
def test_split_keeps_every_item_in_order_and_balances_bytes(parts: int) -> None:
    rng = random.Random(parts)
    items = candidates([rng.randrange(1_000, 2_000_000) for _ in range(500)])
    out = split(items, parts)
    assert len(out) == parts
    assert [c for part in out for c in part] == items  # contiguous runs, in order, nothing lost or repeated
    total = sum(size for _, size in items)
    largest = max(size for _, size in items)
    for part in out:
        assert part, "an empty part with plenty of items to share"
        assert abs(sum(size for _, size in part) - total / parts) <= largest


def test_split_by_bytes_not_by_count() -> None:
    # one big file then many small ones: the big one is a part on its own
    items = candidates([1000] + [10] * 100)
    first, second = split(items, 2)
    assert [size for _, size in first] == [1000]
    assert len(second) == 100


def test_split_more_parts_than_items() -> None:
    items = candidates([5, 5, 5])
    out = split(items, 8)
    assert len(out) == 8
    assert [c for part in out for c in part] == items
    assert sum(1 for part in out if part) == 3


def test_split_unknown_and_zero_sizes_count_as_one_byte() -> None:
    items = candidates([0, -1, 0, -1])
    out = split(items, 2)
    assert [len(part) for part in out] == [2, 2]


def test_a_block_sent_to_its_rank_carries_its_own_rows_only() -> None:
    records = records_to_table([image(f"img{i:06d}.jpg", 64, 64) for i in range(20_000)])
    whole = pickle.dumps(Block(records, records.slice(0, 0)))
    block = Block(records.slice(10_000, 100), records.slice(500, 3))
    sent = pickle.dumps(block)
    assert len(sent) < len(whole) / 50  # a pickled slice would carry all 20,000 rows
    received = pickle.loads(sent)
    assert received.todo.equals(block.todo) and received.reused.equals(block.reused)


def test_split_keeps_joined_rows_with_the_row_before() -> None:
    items = candidates([10, 10, 10, 10])
    assert [len(part) for part in split(items, 2)] == [2, 2]
    assert [len(part) for part in split(items, 2, [False, False, True, False])] == [3, 1]  # rows 1 and 2: one path


def test_split_nothing() -> None:
    assert split([], 4) == [[], [], [], []]


# --- parse_max_errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "files", "expected"),
    [
        ("1%", 1000, 10),
        ("5", 1000, 5),
        ("5", 0, 5),
        (" 12 ", 10, 12),
        ("0", 1000, 0),
        ("1%", 50, 0),  # rounded down
        ("1%", 199, 1),
        ("0.5%", 1000, 5),
        ("100%", 37, 37),
        ("29%", 100, 29),  # not 28.999...
        ("57%", 100, 57),
        ("0.7%", 1000, 7),
        ("12.5%", 8, 1),
    ],
)
def test_parse_max_errors(value: str, files: int, expected: int) -> None:
    assert parse_max_errors(value, files) == expected


@pytest.mark.parametrize("value", ["", "abc", "%", "1.5", "ten%", "5 files", "inf%", "nan%", "1%%"])
def test_parse_max_errors_rejects_bad_values(value: str) -> None:
    with pytest.raises(InputError, match="--max-errors"):
        parse_max_errors(value, 1000)
