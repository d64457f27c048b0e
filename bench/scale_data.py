"""bench/scale.py's data at N images, made once under --data and reused while complete: N files that are hard links to
a few real images (FILES_PER_DIR to a directory), a table of their paths, captions and sizes, and the same N images as
objects of a bucket on a local S3 server (SeaweedFS `weed mini`, the tests' WeedServer)."""

from __future__ import annotations

import io
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from stk.datagen import make_image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.weed_server import WeedServer, s3_client  # the tests' S3 server, started the same way

FILES_PER_DIR = 1000
LINKS_PER_SOURCE = 60_000  # hard links to one source file (ext4 takes 65,000)
REAL_SIZES = ((1024, 768), (768, 1024), (1024, 1024), (1216, 832))  # every one kept by stk-scan's default filters
S3_PREFIX = "images"
UPLOAD_THREADS = 16


def relative_path(i: int) -> str:
    return f"d{i // FILES_PER_DIR:05d}/{i:08d}.jpg"


def real_images(data: Path) -> list[Path]:
    """The few real JPEGs every file links to."""
    directory = data / "real"
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, (width, height) in enumerate(REAL_SIZES):
        path = directory / f"{k}.jpg"
        if not path.exists():
            make_image(width, height, seed=k).save(path, quality=85)
        paths.append(path)
    return paths


def _flat_jpegs() -> list[bytes]:
    """JPEGs of the real images' sizes, of one colour: a few KB each. stk-scan reads only their headers, and a bucket
    of 1M full-size ones (about 47 GB in the server's volumes) would not fit the disk beside the other data."""
    blobs = []
    for k, size in enumerate(REAL_SIZES):
        buffer = io.BytesIO()
        Image.new("RGB", size, (40 * k, 90, 160)).save(buffer, "JPEG", quality=50, optimize=True)
        blobs.append(buffer.getvalue())
    return blobs


def link_source(data: Path, images: int, real: list[Path], i: int) -> Path:
    """The file image `i` links to: a copy of one of the real JPEGs per LINKS_PER_SOURCE links, outside the tree,
    since a file takes at most 65,000 links on ext4."""
    group, k = divmod(i, len(real))
    source = data / f"sources-{images}" / f"{group // LINKS_PER_SOURCE}-{k}.jpg"
    if not source.exists():
        source.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real[k], source)
    return source


def ensure_files(data: Path, images: int) -> tuple[Path, Path]:
    """DATA/files-N (the tree) and DATA/files-N.parquet (path relative to DATA, caption, width, height)."""
    root, table, stamp = data / f"files-{images}", data / f"files-{images}.parquet", data / f"files-{images}.done"
    if stamp.exists():
        return root, table
    print(f"data: {images} hard links in {root} and their table ...", flush=True)
    real = real_images(data)
    for i in range(images):
        path = root / relative_path(i)
        if i % FILES_PER_DIR == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.link(link_source(data, images, real, i), path)
    sizes = [REAL_SIZES[i % len(REAL_SIZES)] for i in range(images)]
    columns = {
        "path": [f"{root.name}/{relative_path(i)}" for i in range(images)],
        "caption": [f"a photo of thing {i}" for i in range(images)],
        "width": [w for w, _ in sizes],
        "height": [h for _, h in sizes],
    }
    pq.write_table(pa.table(columns), table)
    stamp.touch()
    return root, table


def without_captions(table: Path) -> Path:
    """TABLE's paths and sizes without its caption column (made once, next to it): a scan of it looks for sidecars."""
    bare = table.with_name(f"{table.stem}-nocaption.parquet")
    if not bare.exists():
        pq.write_table(pq.read_table(table, columns=["path", "width", "height"]), bare)
    return bare


def start_s3(data: Path) -> WeedServer:
    """The local S3 server on DATA/weed (its objects kept between runs)."""
    (data / "weed").mkdir(parents=True, exist_ok=True)
    server = WeedServer(data / "weed")
    server.start()
    return server


def ensure_bucket(data: Path, client: Any, images: int) -> str:
    """Bucket scale-N holding the N images under S3_PREFIX/, uploaded with UPLOAD_THREADS; its s3:// URL."""
    bucket, stamp = f"scale-{images}", data / f"s3-{images}.done"
    url = f"s3://{bucket}/{S3_PREFIX}"
    if stamp.exists():
        return url
    print(f"data: {images} objects in {url} ...", flush=True)
    real = _flat_jpegs()
    existing = {b["Name"] for b in client.list_buckets()["Buckets"]}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)

    def put(i: int) -> None:
        client.put_object(Bucket=bucket, Key=f"{S3_PREFIX}/{relative_path(i)}", Body=real[i % len(real)])

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, range(images)))
    stamp.touch()
    return url


__all__ = ["S3_PREFIX", "ensure_bucket", "ensure_files", "real_images", "s3_client", "start_s3", "without_captions"]
