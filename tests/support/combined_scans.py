"""A scan directory of several datasets written by hand, as `stk-scan --datasets` writes it (metadata.parquet with a
`dataset` column and full paths, buckets.json with its "datasets", summary.json's root ""), of real PNG images; or
the same rows as a scan of one source (no `dataset` column, no "datasets")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stk.datagen import make_image
from stk.scan.outputs import BUCKETS, METADATA, METADATA_SCHEMA, SUMMARY

STYLE, PHOTOS = "style", "photos"
# name, crop, bucket (width, height), image (width, height): the style set's wide images are cropped at random to
# their bucket (the center crop's offset is (0, 16)), the photos fit theirs at another resolution and take --crop
DATASETS: list[tuple[str, str | None, tuple[int, int], tuple[int, int]]] = [
    (STYLE, "random", (64, 64), (96, 64)),
    (PHOTOS, None, (48, 32), (72, 48)),
]
CENTER_OFFSET = (0, 16)  # (top, left) of a style image cropped at the center


def _dataset(where: Path, index: int, images: int) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """One dataset's rows, its bucket and its entry of buckets.json's "datasets"."""
    name, crop, (bucket_w, bucket_h), (width, height) = DATASETS[index]
    folder = where / "images" / name
    folder.mkdir(parents=True)
    rows = []
    for i in range(images):
        path = folder / f"im{i}.png"
        make_image(width, height, seed=10 * index + i).save(path)
        rows.append(
            {
                "path": str(path),
                "filename": str(path),
                "width": width,
                "height": height,
                "caption": f"{name} {i % 2}",
                "bucket": index,
                "bucket_width": bucket_w,
                "bucket_height": bucket_h,
                "format": "png",
                "bytes": path.stat().st_size,
                "mtime": path.stat().st_mtime,
                "caption_source": "test",
                "dataset": name,
            }
        )
    bucket = {"id": index, "width": bucket_w, "height": bucket_h, "count": images, "repeats": 1, "dataset": name}
    entry = {
        "name": name,
        "source": str(folder),
        "repeats": 1,
        "weight": None,
        "crop": crop,
        "caption_dropout": None,
        "resolution": bucket_w,
        "resolution_type": "side",
        "images": images,
        "buckets": [index],
    }
    return rows, bucket, entry


def write_scan(where: Path, images: int = 4) -> Path:
    """WHERE/scan: the two DATASETS' rows (`images` each) as a scan of several datasets."""
    rows, buckets, datasets = [], [], []
    for index in range(len(DATASETS)):
        dataset_rows, bucket, entry = _dataset(where, index, images)
        rows += dataset_rows
        buckets.append(bucket)
        datasets.append(entry)
    document = {"resolution": 64, "resolution_type": "side", "alignment": 16, "buckets": buckets, "datasets": datasets}
    schema = METADATA_SCHEMA.append(pa.field("dataset", pa.string()))
    return _write(where / "scan", pa.Table.from_pylist(rows, schema=schema), document)


def one_source(scan: Path) -> Path:
    """The same rows beside it as a scan of one source: no `dataset` column, no "datasets"."""
    document = json.loads((scan / BUCKETS).read_text())
    del document["datasets"]
    return _write(scan.parent / "one-source", pq.read_table(scan / METADATA).drop_columns(["dataset"]), document)


def _write(scan: Path, table: pa.Table, document: dict[str, Any]) -> Path:
    scan.mkdir()
    pq.write_table(table, scan / METADATA)
    (scan / BUCKETS).write_text(json.dumps(document))
    (scan / SUMMARY).write_text(json.dumps({"root": ""}))
    return scan
