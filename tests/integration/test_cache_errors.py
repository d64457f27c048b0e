"""stk-cache's one-line errors: a missing scan, no model, an empty prompt file, a damaged scan table or shard, a wrong
bucket or endpoint, each with its exit code and the fix."""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cache_builds import Built, Scanned, error_lines, run_cache, run_scan

from stk.models import Family
from stk.models.families import family_hint

pytestmark = pytest.mark.integration


def test_a_missing_scan_a_directory_that_is_no_model_or_of_no_known_family_or_an_empty_prompt_file_is_exit_3(
    models: dict[Family, str], scanned: Scanned, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-scan"
    proc = run_cache([missing, "--model", models[Family.SD], "--out", tmp_path / "cache1"])
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = error_lines(proc)
    assert len(lines) == 1 and str(missing) in lines[0], proc.stderr
    assert not (tmp_path / "cache1").exists()

    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    proc = run_cache([scanned.scan, "--model", not_a_model, "--out", tmp_path / "cache2"])
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = error_lines(proc)
    assert len(lines) == 1 and "model_index.json" in lines[0] and str(not_a_model) in lines[0], proc.stderr
    assert not (tmp_path / "cache2").exists()

    (not_a_model / "model_index.json").write_text('{"_class_name": "WanPipeline"}')  # a family stk does not know
    proc = run_cache([scanned.scan, "--model", not_a_model, "--out", tmp_path / "cache2"])
    lines = error_lines(proc)
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert "pipeline 'WanPipeline' is not one stk knows" in lines[0] and family_hint() in lines[0]
    assert not (tmp_path / "cache2").exists()

    # a text encoder larger than this host's memory (a real checkpoint file, sparse: 1 TiB of zeros taking no disk),
    # for --device cpu: refused from its safetensors header in one line naming its size, before any weight loads
    huge = tmp_path / "huge-model"
    shutil.copytree(models[Family.SD], huge)
    weights = huge / "text_encoder" / "model.safetensors"
    write_sparse_safetensors(weights, "text_model.embeddings.token_embedding.weight", [2**28, 1024])
    proc = run_cache([scanned.scan, "--model", huge, "--out", tmp_path / "cache-huge", "--device", "cpu"])
    lines = error_lines(proc)
    assert proc.returncode == 3 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{huge}: 1099.5 GB of text encoders and a 0.0 GB VAE do not fit on cpu, which has " in lines[0]
    assert "use a host with more memory" in lines[0] and "--two-pass does not help on the CPU" in lines[0]
    assert not (tmp_path / "cache-huge" / "shards").exists()

    empty = tmp_path / "prompts.txt"
    empty.write_text("\n \n")
    proc = run_cache(
        [scanned.scan, "--model", models[Family.SD], "--out", tmp_path / "cache3", "--validation-prompts", empty]
    )
    lines = error_lines(proc)
    assert proc.returncode == 3 and len(lines) == 1 and f"{empty}: no prompts in it (one per line)" in lines[0]
    assert not (tmp_path / "cache3").exists()


def write_sparse_safetensors(path: Path, name: str, shape: list[int]) -> None:
    """A float32 safetensors file of one tensor, its data a hole: the file has its full size but no blocks."""
    size = 4 * math.prod(shape)
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)


def test_a_truncated_scan_table_a_missing_or_an_empty_shard_are_exit_6_naming_the_file_and_the_fix(
    scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    """Damage is exit 6 in one line naming the file and what rebuilds it; found before any model loads (the model
    given here is no model)."""
    scan = tmp_path / "scan"
    shutil.copytree(scanned.scan, scan)
    table = scan / "metadata.parquet"
    table.write_bytes(table.read_bytes()[:200])
    proc = run_cache([scan, "--model", tmp_path / "no-model", "--out", tmp_path / "out"])
    assert proc.returncode == 6, proc.stderr
    (line,) = error_lines(proc)
    assert "Traceback" not in proc.stderr and f"{table} is damaged (not a readable parquet file" in line
    assert f"`stk-scan {scanned.data} --out {scan}`" in line
    assert not (tmp_path / "out").exists()
    proc = run_cache(["verify", built(Family.SD).path, "--scan", scan])
    assert proc.returncode == 6 and f"{table} is damaged" in error_lines(proc)[0], proc.stderr
    proc = run_cache([tmp_path, "--model", tmp_path / "no-model", "--out", tmp_path / "out"])
    assert proc.returncode == 3 and "not an stk-scan output directory" in error_lines(proc)[0], proc.stderr

    for damage in ("missing", "empty"):
        cache = tmp_path / f"cache-{damage}"
        shutil.copytree(built(Family.SD).path, cache)
        shard = sorted((cache / "shards").iterdir())[0]
        shard.unlink() if damage == "missing" else shard.write_bytes(b"")
        proc = run_cache(["info", cache])
        assert proc.returncode == 6, proc.stderr
        (line,) = error_lines(proc)
        assert "Traceback" not in proc.stderr and f"shard {shard} is damaged" in line
        assert f"`stk-cache verify {cache} --repair`" in line


@contextlib.contextmanager
def web_server() -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 (HTML pages, 404 and 501 answers): not S3."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("endpoint", ["missing-bucket", "unresolvable-host", "not-s3"])
def test_a_wrong_bucket_or_endpoint_is_one_line_and_exit_3_before_the_model_loads(
    scanned: Scanned, s3_server: str, tmp_path: Path, endpoint: str
) -> None:
    """The model given is no model: the storage error comes first, so no model was loaded."""
    bucket = f"stk-missing-{uuid.uuid4().hex[:10]}"
    with contextlib.ExitStack() as stack:
        url = {
            "missing-bucket": s3_server,
            "unresolvable-host": "http://no-such-host.invalid:8333",
            "not-s3": stack.enter_context(web_server()) if endpoint == "not-s3" else "",
        }[endpoint]
        started = time.monotonic()
        proc = run_cache(
            [scanned.scan, "--model", tmp_path / "no-model", "--out", f"s3://{bucket}/cache", "--s3-endpoint-url", url]
        )
        seconds = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = error_lines(proc)
    assert url in line and "no-model" not in line, line
    assert {
        "missing-bucket": f"S3 bucket '{bucket}' does not exist",
        "unresolvable-host": "the host name no-such-host.invalid does not resolve",
        "not-s3": "does not answer as S3 (HTTP 404 to ListObjectsV2",
    }[endpoint] in line, line
    assert seconds < 60, "retried as an outage"


def test_buckets_the_family_cannot_train_are_refused_before_the_model_loads_naming_the_nearest_sizes(
    models: dict[Family, str], scanned: Scanned, tmp_path: Path
) -> None:
    scan = tmp_path / "scan"
    run_scan([scanned.data, "--out", scan, "--resolution", "64", "--alignment", "8"])
    buckets = json.loads((scan / "buckets.json").read_text())["buckets"]
    assert any(b["count"] and b["width"] % 16 for b in buckets), "the scan must use a bucket Flux cannot train"
    proc = run_cache([scan, "--model", models[Family.FLUX], "--out", tmp_path / "cache"])
    lines = error_lines(proc)
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert "Flux needs sides that are multiples of 16, nearest" in lines[0], lines
    assert "scan again with stk-scan --family flux" in lines[0] and str(scan) in lines[0], lines
    assert not (tmp_path / "cache").exists()
