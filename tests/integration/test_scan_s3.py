"""stk-scan against a real S3 server (SeaweedFS): same rows as a local scan, incremental
reruns keyed on ETags, a clear error for a missing bucket, and header-only ranged reads."""

from __future__ import annotations

import io
import random
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from support.commands import RunScan, summary_of
from support.weed_server import S3_ENV, s3_client

from stk.datagen import generate_dataset, make_image

pytestmark = pytest.mark.integration

COMPARED = ("path", "width", "height", "caption", "caption_source", "bucket", "bucket_width", "bucket_height", "format")


def _rows(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "metadata.parquet").to_pylist()


def _upload_tree(client: Any, root: Path, bucket: str, prefix: str) -> list[str]:
    keys = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(root).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
            keys.append(key)
    return keys


def _new_bucket(client: Any) -> str:
    name = f"stk-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def uploaded(tmp_path: Path, s3_server: str) -> tuple[Path, str, Any]:
    """A dataset with no filtered images (aspect within 2:1), local and in a fresh bucket under
    the prefix 'train/set1'; returns (local root, s3 URL, client)."""
    root = tmp_path / "local"
    generate_dataset(str(root), count=30, seed=7, min_side=64, max_side=120)
    client = s3_client(s3_server)
    bucket = _new_bucket(client)
    keys = _upload_tree(client, root, bucket, "train/set1")
    assert any(k.endswith(".txt") for k in keys) and any(k.endswith(".jpg") for k in keys)
    return root, f"s3://{bucket}/train/set1", client


def test_s3_scan_matches_local_scan(uploaded: tuple[Path, str, Any], s3_server: str, run_scan: RunScan, tmp_path: Path):
    root, url, _ = uploaded
    local = run_scan([root, "--out", tmp_path / "out-local"])
    assert local.returncode == 0, local.stderr
    remote = run_scan([url, "--out", tmp_path / "out-s3", "--s3-endpoint-url", s3_server])
    assert remote.returncode == 0, remote.stderr
    assert "Traceback" not in remote.stderr

    local_rows, remote_rows = _rows(tmp_path / "out-local"), _rows(tmp_path / "out-s3")
    assert len(remote_rows) == 30
    assert [{k: r[k] for k in COMPARED} for r in remote_rows] == [{k: r[k] for k in COMPARED} for r in local_rows]
    # sizes are the same; S3 rows carry the ETag, local rows none
    assert [r["bytes"] for r in remote_rows] == [r["bytes"] for r in local_rows]
    assert all(r["etag"] for r in remote_rows)
    assert {r["caption_source"] for r in remote_rows} >= {"sidecar", "filename"}
    summary = summary_of(remote)
    assert summary["files"] == summary["images"] == summary["scanned"] == 30
    assert summary["errors"] == 0


def test_an_s3_and_a_local_dataset_in_one_scan(
    uploaded: tuple[Path, str, Any], s3_server: str, run_scan: RunScan, tmp_path: Path
):
    root, url, _ = uploaded
    listed = tmp_path / "datasets.toml"
    listed.write_text(
        f'[[dataset]]\nname = "remote"\nsource = "{url}"\n\n[[dataset]]\nname = "local"\nsource = "{root}"\n'
    )
    proc = run_scan(["--datasets", listed, "--out", tmp_path / "out", "--s3-endpoint-url", s3_server])
    assert proc.returncode == 0, proc.stderr
    rows = _rows(tmp_path / "out")
    assert [r["dataset"] for r in rows] == ["remote"] * 30 + ["local"] * 30
    assert [r["path"].removeprefix(url + "/") for r in rows[:30]] == [
        r["path"].removeprefix(f"{root}/") for r in rows[30:]
    ]
    assert all(r["path"].startswith(url + "/") and r["etag"] for r in rows[:30])

    empty = tmp_path / "empty.toml"  # a prefix with no objects: refused before the local dataset is read
    empty.write_text(
        f'[[dataset]]\nname = "local"\nsource = "{root}"\n\n[[dataset]]\nname = "none"\nsource = "{url}-none"\n'
    )
    refused = run_scan(["--datasets", empty, "--out", tmp_path / "refused", "--s3-endpoint-url", s3_server])
    assert refused.returncode == 3 and "dataset 'none'" in refused.stderr and "holds no objects" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused" / "datasets").exists()


def test_s3_incremental_rerun(uploaded: tuple[Path, str, Any], s3_server: str, run_scan: RunScan, tmp_path: Path):
    _, url, client = uploaded
    bucket, prefix = url[len("s3://") :].split("/", 1)
    out = tmp_path / "out"
    args = [url, "--out", out, "--s3-endpoint-url", s3_server]
    first = run_scan(args)
    assert first.returncode == 0, first.stderr
    before = {r["path"]: r for r in _rows(out)}

    again = summary_of(run_scan(args))
    assert (again["files"], again["reused"], again["scanned"]) == (30, 30, 0)
    assert {r["path"]: r for r in _rows(out)} == before

    # replace one image with another of a different size, delete another
    changed, deleted = sorted(before)[3], sorted(before)[10]
    buffer = io.BytesIO()
    make_image(100, 70, seed=99).save(buffer, "PNG")
    client.put_object(Bucket=bucket, Key=f"{prefix}/{changed}", Body=buffer.getvalue())
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{deleted}")

    proc = run_scan(args)
    assert proc.returncode == 0, proc.stderr
    third = summary_of(proc)
    assert (third["files"], third["scanned"], third["reused"]) == (29, 1, 28)
    after = {r["path"]: r for r in _rows(out)}
    assert deleted not in after
    assert (after[changed]["width"], after[changed]["height"]) == (100, 70)
    assert after[changed]["etag"] != before[changed]["etag"]
    for path in set(after) - {changed}:
        assert after[path] == before[path]


def test_s3_missing_bucket_is_one_clear_line(s3_server: str, run_scan: RunScan, tmp_path: Path):
    bucket = f"stk-missing-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    proc = run_scan([f"s3://{bucket}/images", "--out", out, "--s3-endpoint-url", s3_server])
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    assert bucket in errors[0] and s3_server in errors[0]
    assert proc.stdout == ""
    assert not (out / "metadata.parquet").exists()


def test_s3_headers_are_read_with_ranged_gets(s3_server: str, monkeypatch: pytest.MonkeyPatch):
    """Probe one large object in-process, counting what every S3 read fetches."""
    from stk import storage
    from stk.scan.candidates import CANDIDATE_SCHEMA, ready, settle
    from stk.scan.probe import ProbeOptions, probe
    from stk.storage.s3 import S3Backend

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)

    rng = random.Random(5)
    noise = Image.frombytes("RGB", (3000, 2000), rng.randbytes(3000 * 2000 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, "JPEG", quality=95)
    data = buffer.getvalue()
    assert len(data) > 4_000_000  # several MB

    client = s3_client(s3_server)
    bucket = _new_bucket(client)
    client.put_object(Bucket=bucket, Key="big/noise.jpg", Body=data)
    client.put_object(Bucket=bucket, Key="big/noise.txt", Body=b"static\n")

    fetched: list[tuple[str, int, int]] = []
    whole: list[str] = []
    read_range, read_bytes = S3Backend.read_range, S3Backend.read_bytes

    def counting_read_range(self: S3Backend, location: str, start: int, end: int) -> bytes:
        out = read_range(self, location, start, end)
        fetched.append((location, start, len(out)))
        return out

    def counting_read_bytes(self: S3Backend, location: str) -> bytes:
        whole.append(location)
        return read_bytes(self, location)

    monkeypatch.setattr(S3Backend, "read_range", counting_read_range)
    monkeypatch.setattr(S3Backend, "read_bytes", counting_read_bytes)
    storage.configure_s3(s3_server)
    try:
        location = f"s3://{bucket}/big/noise.jpg"
        info = storage.stat(location)
        assert info.size == len(data)
        given = {
            "path": "noise.jpg",
            "location": location,
            "size": info.size,
            "mtime": info.mtime,
            "etag": info.etag,
            "caption_location": f"s3://{bucket}/big/noise.txt",
            "caption_fingerprint": "",
            "find_sidecar": False,
        }
        (cand,) = ready(settle(pa.Table.from_pylist([given], schema=CANDIDATE_SCHEMA), threads=1), "").to_pylist()
        record = probe(cand, ProbeOptions())
    finally:
        storage.configure_s3(None)

    assert record["kind"] is None, record
    assert (record["width"], record["height"], record["format"]) == (3000, 2000, "JPEG")
    assert record["caption"] == "static"
    total = sum(n for _, _, n in fetched)
    assert fetched and all(loc == location for loc, _, _ in fetched)
    assert total < len(data) // 20, f"fetched {total} of {len(data)} bytes in {len(fetched)} reads"
    assert any(start >= len(data) - 64 * 1024 for _, start, _ in fetched)  # the tail check is a ranged read too
    assert whole == [f"s3://{bucket}/big/noise.txt"]  # only the caption is read whole


def test_s3_scan_on_two_ranks(uploaded: tuple[Path, str, Any], s3_server: str, run_scan: RunScan, tmp_path: Path):
    """Every rank reaches the endpoint given on the command line, and the result is the same."""
    _, url, _ = uploaded
    args = ["--s3-endpoint-url", s3_server, "--gpus", "1", "--threads", "2"]
    one = run_scan([url, "--out", tmp_path / "one", *args])
    assert one.returncode == 0, one.stderr
    two = run_scan([url, "--out", tmp_path / "two", *args], mpi=2)
    assert two.returncode == 0, two.stderr
    assert summary_of(two)["ranks"] == 2 and summary_of(two)["scanned"] == 30
    tables = [pq.read_table(tmp_path / name / "metadata.parquet") for name in ("one", "two")]
    assert tables[1].equals(tables[0])
    assert (tmp_path / "two" / "buckets.json").read_bytes() == (tmp_path / "one" / "buckets.json").read_bytes()


def test_s3_sidecars_of_a_list_come_from_one_listing(s3_server: str, monkeypatch: pytest.MonkeyPatch):
    """Images named by a list look for sidecars: a prefix holding several is listed once (no HEAD per name), with the
    records that asking for each name gives."""
    from concurrent.futures import ThreadPoolExecutor

    from stk import storage
    from stk.scan.candidates import from_list, ready, settle
    from stk.scan.probe import ProbeOptions, probe
    from stk.scan.sidecars import listed_for
    from stk.storage.s3 import S3Backend

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    client, buffer = s3_client(s3_server), io.BytesIO()
    bucket = _new_bucket(client)
    make_image(16, 8, seed=1).save(buffer, "PNG")
    urls = [f"s3://{bucket}/set/img{i}.png" for i in range(5)]
    for url in urls:
        client.put_object(Bucket=bucket, Key=url.split("/", 3)[3], Body=buffer.getvalue())
    client.put_object(Bucket=bucket, Key="set/img0.txt", Body=b"zero\n")
    client.put_object(Bucket=bucket, Key="set/img1.caption", Body=b"one\n")
    client.put_object(Bucket=bucket, Key="set/img2.txt/inner", Body=b"")  # a 'directory', not a caption
    asked: list[str] = []
    exists = S3Backend.exists
    monkeypatch.setattr(S3Backend, "exists", lambda self, location: asked.append(location) or exists(self, location))
    storage.configure_s3(s3_server)
    try:
        table = ready(settle(from_list(urls), threads=2), "")
        one_by_one = [probe(cand, ProbeOptions()) for cand in table.to_pylist()]
        assert len(asked) == 9  # one for img0 (its .txt), two for each other image
        asked.clear()
        with ThreadPoolExecutor(2) as pool:
            found = listed_for(table, pool)
        listed = [probe(cand, ProbeOptions(), found) for cand in table.to_pylist()]
    finally:
        storage.configure_s3(None)
    assert listed == one_by_one and asked == []
    assert [(r["caption"], r["caption_source"]) for r in listed] == [
        ("zero", "sidecar"),
        ("one", "sidecar"),
        ("img2", "filename"),
        ("img3", "filename"),
        ("img4", "filename"),
    ]
