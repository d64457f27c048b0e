"""S3 and S3-compatible stores (R2, MinIO, SeaweedFS) through boto3.

Credentials come only from boto3's standard chain (environment, profile, instance role); the endpoint from
`configure_s3(endpoint_url=...)`, or boto3's own AWS_ENDPOINT_URL(_S3) / profile.

Outages are ridden through in two layers. botocore's standard retry mode absorbs blips (a few attempts, its own backoff
and throttling handling). Past that, every call goes through `_call`, which retries transient failures (no connection,
timeouts, 5xx, throttling: botocore's own classification) with backoff until `retry_seconds` have passed since the call,
or the endpoint, stopped answering; then it raises InfraError. Each waiting period is logged once per process, when it
starts and when it ends, whatever the number of threads waiting in it. Errors that a retry cannot fix (no bucket, access
denied, no such key) are raised at once, and so are two that look like an outage but are a wrong --s3-endpoint-url: a
host name that has never resolved in this process (one that resolved before and fails now is an outage: a DNS server can
go down), and a server that answers HTTP without S3's error documents (a web server, a proxy's own page). Which
error is which: s3errors.py.
"""

from __future__ import annotations

import io
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

from stk.errors import InfraError, InputError
from stk.log import get_logger
from stk.storage.base import FileInfo
from stk.storage.modes import honour_umask
from stk.storage.ranged import RangedReader
from stk.storage.s3errors import cause_of, reason, transient, translate

__all__ = ["DEFAULT_RETRY_SECONDS", "S3Backend", "configure_s3", "list_entries", "split_url"]

DEFAULT_RETRY_SECONDS = 120.0

T = TypeVar("T")
log = get_logger("storage.s3")

_settings: dict[str, Any] = {"endpoint_url": None, "retry_seconds": DEFAULT_RETRY_SECONDS}
_lock = threading.Lock()
_client: Any = None

_READ_BLOCK = 64 * 1024
_BACKOFF = (0.5, 8.0)  # seconds: first wait between retries, longest wait
_SETTLE_S = 10.0  # failures this soon after the endpoint answered again are the tail of the same outage


def configure_s3(endpoint_url: str | None = None, retry_seconds: float = DEFAULT_RETRY_SECONDS) -> None:
    """Set the endpoint and the retry budget for this process (before the first S3 call)."""
    global _client, _outage
    _settings["endpoint_url"] = endpoint_url or None
    _settings["retry_seconds"] = float(retry_seconds)
    _client = None
    _outage = _Outage()  # another endpoint: nothing is known of its outages


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise InputError(f"{url}: an S3 URL needs a bucket: s3://bucket/prefix")
    return bucket, key


def client() -> Any:
    """One boto3 client per process (boto3 clients are thread-safe; sessions are not).

    Timeouts scale with the retry budget (at most 10 s): an endpoint that accepts connections but
    never answers (a stopped process, a dead load balancer) must be noticed well within it."""
    global _client
    with _lock:
        if _client is None:
            import boto3
            import botocore.session
            from botocore.config import Config

            endpoint = _settings["endpoint_url"]
            timeout = min(10.0, max(1.0, _settings["retry_seconds"] / 12))
            config = Config(
                retries={"mode": "standard", "max_attempts": 2},
                connect_timeout=timeout,
                read_timeout=timeout,
                max_pool_connections=64,
                s3={"addressing_style": "path"} if endpoint else {},
            )
            core = botocore.session.get_session()
            core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
            _client = boto3.session.Session(botocore_session=core).client("s3", endpoint_url=endpoint, config=config)
        return _client


def _timestamp(value: str) -> datetime:
    """S3's ISO 8601 times, parsed by Python: botocore's parser (dateutil) took 60% of a listing's time."""
    try:
        return datetime.fromisoformat(value)
    except ValueError:  # HTTP dates (HeadObject), or an older Python
        from botocore.utils import parse_timestamp

        return parse_timestamp(value)


def _endpoint() -> str:
    return str(client().meta.endpoint_url)


class _Outage:
    """The waiting period the endpoint is in, shared by every thread of the process, so that it is
    logged once when it starts and once when it ends, not once per thread or per attempt.

    A server that comes back often fails a few more requests while it warms up (SeaweedFS answers
    HTTP 500 for a few seconds after a restart): failures within `_SETTLE_S` of the end of a
    waiting period are logged only if they last that long themselves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resolved = False  # the endpoint's host name has resolved in this process
        self.since: float | None = None
        self._logged = False
        self._ended = float("-inf")

    def failed(self, reason: str) -> float:
        """Note a transient failure; returns when the current waiting period began."""
        with self._lock:
            now = time.monotonic()
            if self.since is None:
                self.since, self._logged = now, False
            if not self._logged and (now - self._ended >= _SETTLE_S or now - self.since >= _SETTLE_S):
                self._logged = True
                log.warning(
                    "S3 endpoint %s is not answering (%s); retrying for up to %g s (--s3-retry-seconds)",
                    _endpoint(),
                    reason,
                    _settings["retry_seconds"],
                )
            return self.since

    def answered(self) -> None:
        self.resolved = True
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.since is None:
                return
            if self._logged:
                log.warning("S3 endpoint %s answers again, after %.0f s", _endpoint(), time.monotonic() - self.since)
            self.since, self._ended = None, time.monotonic()


_outage = _Outage()


def _call(fn: Callable[[], T], bucket: str, key: str) -> T:
    """fn() (one S3 request, with its body read), retried with backoff through transient failures
    until the budget has passed since this call or the endpoint started failing; errors in the
    terms of storage (FileNotFoundError, OSError, InputError, InfraError)."""
    first_failure: float | None = None
    delay = _BACKOFF[0]
    while True:
        try:
            result = fn()
        except Exception as exc:
            if not transient(exc):
                raise translate(exc, _endpoint, bucket, key) from exc
            unresolved = _unresolved(exc)
            if unresolved is not None:
                raise unresolved from None
            now = time.monotonic()
            first_failure = first_failure or now
            budget = _settings["retry_seconds"]
            left = min(first_failure, _outage.failed(reason(exc))) + budget - now
            if left <= 0:
                raise InfraError(
                    f"S3 endpoint {_endpoint()} did not answer for {budget:g} s (s3://{bucket}/{key}: {reason(exc)}): "
                    "rerun when it is back, or raise --s3-retry-seconds"
                ) from exc
            time.sleep(min(left, delay * random.uniform(0.5, 1.0)))
            delay = min(delay * 2, _BACKOFF[1])
            continue
        _outage.answered()
        return result


def _unresolved(exc: Exception) -> InputError | None:
    """For a failure to connect: an InputError when the endpoint's host name does not resolve and
    never did in this process (a typo would otherwise be retried as an outage, then requeued as
    one, forever); None when it resolves, or did before."""
    from botocore.exceptions import ClientError

    if _outage.resolved or isinstance(cause_of(exc), ClientError):  # an HTTP answer: the name resolved
        return None
    endpoint = _endpoint()
    host = urlsplit(endpoint).hostname
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as error:
        return InputError(
            f"S3 endpoint {endpoint}: the host name {host} does not resolve ({error.strerror}): "
            "check --s3-endpoint-url (or AWS_ENDPOINT_URL)"
        )
    _outage.resolved = True
    return None


def list_entries(
    root: str, under: str = "", after: str = "", levels: bool = False, keys: int = 1000
) -> Iterator[FileInfo]:
    """Objects under `root` with keys (relative to it) from `under`, after `after`; by `levels` (delimiter "/") also
    common prefixes (size -1), a page sorted. Page by page (not boto3's paginator): a failed page is retried alone."""
    bucket, prefix = split_url(root)
    prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix + under, "MaxKeys": keys}
    request.update(({"StartAfter": prefix + after} if after else {}) | ({"Delimiter": "/"} if levels else {}))
    while True:
        page = _call(lambda: client().list_objects_v2(**request), bucket, request["Prefix"])
        entries = [
            FileInfo(
                o["Key"][len(prefix) :],
                f"s3://{bucket}/{o['Key']}",
                int(o["Size"]),
                o["LastModified"].timestamp(),
                etag=str(o.get("ETag", "")).strip('"'),
            )
            for o in page.get("Contents", [])
        ]
        if levels:  # and each common prefix, of size -1
            common = [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            entries += [FileInfo(key[len(prefix) :], f"s3://{bucket}/{key}", -1, 0.0) for key in common]
            entries.sort(key=lambda entry: entry.key)
        yield from entries
        if not page.get("IsTruncated"):
            return
        request["ContinuationToken"] = page["NextContinuationToken"]


class S3Backend:
    def list_files(self, root: str) -> Iterator[FileInfo]:
        return (info for info in list_entries(root) if not info.key.endswith("/"))  # not folder markers ("a/")

    def names(self, directory: str) -> Iterator[str]:
        """The objects directly under the prefix `directory` (what exists() finds there), a page at a time."""
        return (info.key for info in list_entries(directory, levels=True) if info.size >= 0)

    def stat(self, location: str) -> FileInfo:
        bucket, key = split_url(location)
        head = _call(lambda: client().head_object(Bucket=bucket, Key=key), bucket, key)
        return FileInfo(
            location,
            location,
            int(head["ContentLength"]),
            head["LastModified"].timestamp(),
            str(head["ETag"]).strip('"'),
        )

    def exists(self, location: str) -> bool:
        try:
            self.stat(location)
        except FileNotFoundError:
            return False
        return True

    def open_read(self, location: str, size: int | None) -> BinaryIO:
        if size is None:
            size = self.stat(location).size
        ranged = RangedReader(lambda start, end: self.read_range(location, start, end), size)
        return io.BufferedReader(ranged, buffer_size=_READ_BLOCK)

    def read_bytes(self, location: str) -> bytes:
        bucket, key = split_url(location)
        return _call(lambda: bytes(client().get_object(Bucket=bucket, Key=key)["Body"].read()), bucket, key)

    def read_range(self, location: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        bucket, key = split_url(location)
        byte_range = f"bytes={start}-{end - 1}"
        return _call(
            lambda: bytes(client().get_object(Bucket=bucket, Key=key, Range=byte_range)["Body"].read()), bucket, key
        )

    def write_atomic(self, location: str, data: bytes) -> None:
        bucket, key = split_url(location)
        _call(lambda: client().put_object(Bucket=bucket, Key=key, Body=data), bucket, key)

    def delete(self, location: str) -> None:
        bucket, key = split_url(location)
        _call(lambda: client().delete_object(Bucket=bucket, Key=key), bucket, key)

    def upload_file(self, local_path: str, location: str) -> None:
        """boto3's managed transfer: multipart above 8 MiB, parts in parallel; the object appears
        only once every part is there (a retry starts the upload again)."""
        bucket, key = split_url(location)
        _call(lambda: client().upload_file(local_path, bucket, key), bucket, key)

    def download_file(self, location: str, local_path: str) -> None:
        bucket, key = split_url(location)
        directory = os.path.dirname(local_path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        os.close(fd)
        try:
            _call(lambda: client().download_file(bucket, key, tmp), bucket, key)
            honour_umask(tmp)  # mkstemp's 0600, or boto3's own temp file's
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
