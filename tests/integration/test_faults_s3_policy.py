"""S3 outages met by the storage layer in-process: threads ride through one shorter than --s3-retry-seconds, logged
once, and past it raise an infrastructure error naming endpoint, object and budget; errors a retry cannot fix are
not retried.
Every test has its own SeaweedFS server, stopped (SIGSTOP) or killed and started again on the same ports and data."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.s3_outages import _outage, _recover
from support.weed_server import S3_ENV, WeedServer, s3_client

from stk import storage
from stk.errors import InfraError, InputError

pytestmark = pytest.mark.integration


@pytest.fixture
def in_process(weed: WeedServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Handler]:
    """stk.storage in this process pointed at `weed`; yields a handler that records the S3 log."""
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    records = _Records()
    logger = logging.getLogger("stk.storage.s3")
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        storage.configure_s3(None)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


def _bucket(weed: WeedServer, name: str, objects: dict[str, bytes]) -> None:
    client = s3_client(weed.endpoint)
    client.create_bucket(Bucket=name)
    for key, body in objects.items():
        client.put_object(Bucket=name, Key=key, Body=body)


def test_errors_a_retry_cannot_fix_are_raised_at_once(weed: WeedServer, in_process: _Records):
    _bucket(weed, "here", {"a": b"x"})
    storage.configure_s3(weed.endpoint, retry_seconds=60)
    started = time.monotonic()
    with pytest.raises(InputError, match="S3 bucket 'nowhere' does not exist at " + weed.endpoint):
        list(storage.list_files("s3://nowhere/images"))
    with pytest.raises(FileNotFoundError, match="s3://here/missing: no such object"):
        storage.read_bytes("s3://here/missing")
    assert not storage.exists("s3://here/missing")
    assert time.monotonic() - started < 10
    assert in_process.lines == []


def test_wrong_credentials_are_raised_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A server with one identity: another key is refused (InvalidAccessKeyId), never retried."""
    config = tmp_path / "s3.json"
    identity = {"accessKey": S3_ENV["AWS_ACCESS_KEY_ID"], "secretKey": S3_ENV["AWS_SECRET_ACCESS_KEY"]}
    actions = ["Admin", "Read", "Write", "List"]
    config.write_text(json.dumps({"identities": [{"name": "stk", "credentials": [identity], "actions": actions}]}))
    server = WeedServer(tmp_path / "weed", args=(f"-s3.config={config}",))
    server.data.mkdir()
    server.start()
    try:
        _bucket(server, "locked", {"a": b"x"})
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        storage.configure_s3(server.endpoint, retry_seconds=60)
        started = time.monotonic()
        with pytest.raises(InputError, match=r"access denied to s3://locked/a at .*InvalidAccessKeyId"):
            storage.read_bytes("s3://locked/a")
        assert time.monotonic() - started < 10
    finally:
        storage.configure_s3(None)
        server.stop()


def test_a_host_name_that_never_resolved_is_input_and_one_that_resolved_before_is_an_outage(
    weed: WeedServer, in_process: _Records, monkeypatch: pytest.MonkeyPatch
):
    """A typo in the endpoint is exit 3 at once (retried as an outage it would requeue the job forever); a
    name that resolved earlier in the process and then fails is an outage (a DNS server can go down)."""
    storage.configure_s3("http://no-such-host.invalid:8333", retry_seconds=60)
    started = time.monotonic()
    with pytest.raises(InputError, match=r"http://no-such-host\.invalid:8333: the host name .* does not resolve"):
        storage.read_bytes("s3://data/k")
    assert time.monotonic() - started < 10 and in_process.lines == []

    _bucket(weed, "data", {"k": b"v"})
    storage.configure_s3(weed.endpoint.replace("127.0.0.1", "localhost"), retry_seconds=2)
    assert storage.read_bytes("s3://data/k") == b"v"
    _outage(weed, "kill")
    try:

        def no_dns(*args: object, **kwargs: object) -> None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

        monkeypatch.setattr(socket, "getaddrinfo", no_dns)
        with pytest.raises(InfraError, match="did not answer for 2 s"):
            storage.read_bytes("s3://data/k")
    finally:
        monkeypatch.undo()
        _recover(weed, "kill")


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_threads_wait_through_an_outage_logged_once(weed: WeedServer, in_process: _Records, fault: str):
    """Eight threads reading through an 8 s outage all succeed; the wait is logged once when it
    starts and once when it ends, not once per thread or per attempt. (A budget of 30 s makes the
    timeouts 2.5 s, so botocore's two attempts give up on a stopped server within the outage.)"""
    objects = {f"k{i}": bytes([i]) * 1000 for i in range(8)}
    _bucket(weed, "data", objects)
    storage.configure_s3(weed.endpoint, retry_seconds=30)
    assert storage.read_bytes("s3://data/k0") == objects["k0"]  # the client is made, connections open
    _outage(weed, fault)
    results: dict[str, bytes] = {}

    def read(key: str) -> None:
        results[key] = storage.read_bytes(f"s3://data/{key}")

    threads = [threading.Thread(target=read, args=(key,)) for key in objects]
    for thread in threads:
        thread.start()
    time.sleep(8)
    _recover(weed, fault)
    for thread in threads:
        thread.join(timeout=60)
    assert results == objects
    assert in_process.count("is not answering") == 1, in_process.lines
    assert in_process.count("answers again") == 1, in_process.lines
    assert len(in_process.lines) == 2, in_process.lines


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_past_the_budget_is_an_infra_error_naming_endpoint_object_and_budget(
    weed: WeedServer, in_process: _Records, fault: str
):
    _bucket(weed, "data", {"k": b"v"})
    storage.configure_s3(weed.endpoint, retry_seconds=3)
    assert storage.read_bytes("s3://data/k") == b"v"
    _outage(weed, fault)
    started = time.monotonic()
    try:
        with pytest.raises(InfraError) as raised:
            storage.read_bytes("s3://data/k")
        took = time.monotonic() - started
    finally:
        _recover(weed, fault)
    message = str(raised.value)
    assert "\n" not in message
    assert weed.endpoint in message and "s3://data/k" in message and "3 s" in message, message
    assert 3 <= took < 3 + 15, took  # the budget, plus at most one attempt's timeouts
    assert in_process.count("is not answering") == 1, in_process.lines
    assert storage.read_bytes("s3://data/k") == b"v"  # and it works again once the server is back


def test_every_kind_of_call_rides_through(weed: WeedServer, in_process: _Records, tmp_path: Path):
    """Listing (several pages), ranged and whole GETs, HEAD, PUT, multipart upload, download, delete:
    each started while the server is down, each finishing once it is back."""
    _bucket(weed, "all", {f"page/{i:04d}": b"x" for i in range(1005)})
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * (40 * 2**12))  # 10 MiB: boto3 uploads it in parts
    storage.configure_s3(weed.endpoint, retry_seconds=60)
    storage.write_atomic("s3://all/small", b"0123456789")
    calls = {
        "list": lambda: len(list(storage.list_files("s3://all/page"))),
        "range": lambda: storage.open_read("s3://all/small", 10).read(4),
        "get": lambda: storage.read_bytes("s3://all/small"),
        "head": lambda: storage.stat("s3://all/small").size,
        "put": lambda: storage.write_atomic("s3://all/put", b"p"),
        "multipart": lambda: storage.upload_file(str(big), "s3://all/big"),
        "download": lambda: storage.download_file("s3://all/small", str(tmp_path / "copy")),
        "delete": lambda: storage.delete("s3://all/put"),
    }
    weed.kill()
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda n=n, c=c: results.update({n: c()})) for n, c in calls.items()]
    for thread in threads:
        thread.start()
    time.sleep(4)
    weed.start()
    for thread in threads:
        thread.join(timeout=90)
    assert results["list"] == 1005
    assert results["range"] == b"0123"
    assert results["get"] == b"0123456789"
    assert results["head"] == 10
    assert storage.read_bytes("s3://all/big") == big.read_bytes()
    assert (tmp_path / "copy").read_bytes() == b"0123456789"
    assert set(results) == set(calls)
    assert in_process.count("is not answering") == 1, in_process.lines
