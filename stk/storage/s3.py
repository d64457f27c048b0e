"""S3 and S3-compatible stores (R2, MinIO, SeaweedFS) through boto3.

Credentials come only from boto3's standard chain (environment, profile, instance role); the
endpoint from `configure_s3(endpoint_url=...)`, or boto3's own AWS_ENDPOINT_URL(_S3) / profile.
Transient errors are retried by botocore's standard retry mode, with backoff.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from stk.errors import InputError
from stk.storage.base import FileInfo

__all__ = ["S3Backend", "configure_s3", "split_url"]

_settings: dict[str, Any] = {"endpoint_url": None}
_lock = threading.Lock()
_client: Any = None

_READ_BLOCK = 64 * 1024
_MISSING = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}


def configure_s3(endpoint_url: str | None = None) -> None:
    """Set the endpoint for this process (before the first S3 call)."""
    global _client
    _settings["endpoint_url"] = endpoint_url or None
    _client = None


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise InputError(f"{url}: an S3 URL needs a bucket: s3://bucket/prefix")
    return bucket, key


def client() -> Any:
    """One boto3 client per process (boto3 clients are thread-safe; sessions are not)."""
    global _client
    with _lock:
        if _client is None:
            import boto3
            from botocore.config import Config

            endpoint = _settings["endpoint_url"]
            config = Config(
                retries={"mode": "standard", "max_attempts": 8},
                max_pool_connections=64,
                s3={"addressing_style": "path"} if endpoint else {},
            )
            _client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
        return _client


def _endpoint() -> str:
    return str(client().meta.endpoint_url)


def _translate(exc: Exception, bucket: str, key: str = "") -> Exception:
    """botocore errors -> a FileNotFoundError/OSError for one object, or an InputError for the
    bucket as a whole (one clear line naming the bucket and the endpoint)."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _NO_BUCKET:
            return InputError(f"S3 bucket '{bucket}' does not exist at {_endpoint()}")
        if code in _DENIED:
            return InputError(
                f"access denied to s3://{bucket}/{key} at {_endpoint()} ({code}): check the credentials "
                "boto3 finds (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance role)"
            )
        if code in _MISSING:
            return FileNotFoundError(f"s3://{bucket}/{key}: no such object")
        return OSError(f"s3://{bucket}/{key}: S3 error {code}")
    if isinstance(exc, EndpointConnectionError):
        return InputError(f"cannot reach the S3 endpoint {_endpoint()} (bucket '{bucket}')")
    if isinstance(exc, NoCredentialsError):
        return InputError(f"no S3 credentials found for bucket '{bucket}' at {_endpoint()}")
    if isinstance(exc, BotoCoreError):
        return OSError(f"s3://{bucket}/{key}: {exc}")
    return exc


class _RangedObject(io.RawIOBase):
    """A seekable read-only view of one S3 object; each read is one ranged GET."""

    def __init__(self, bucket: str, key: str, size: int) -> None:
        self._bucket, self._key, self._size, self._pos = bucket, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def readall(self) -> bytes:
        """The rest of the object in one GET (io's default would issue one GET per 8 KiB)."""
        data = S3Backend().read_range(f"s3://{self._bucket}/{self._key}", self._pos, self._size)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size:
            return 0
        end = min(self._pos + len(buffer), self._size)
        data = S3Backend().read_range(f"s3://{self._bucket}/{self._key}", self._pos, end)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class S3Backend:
    def list_files(self, root: str) -> Iterator[FileInfo]:
        bucket, prefix = split_url(root)
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"]
                    if key.endswith("/"):
                        continue
                    yield FileInfo(
                        key[len(prefix) :],
                        f"s3://{bucket}/{key}",
                        int(obj["Size"]),
                        obj["LastModified"].timestamp(),
                        etag=str(obj.get("ETag", "")).strip('"'),
                    )
        except Exception as exc:
            raise _translate(exc, bucket, prefix) from exc

    def stat(self, location: str) -> FileInfo:
        bucket, key = split_url(location)
        try:
            head = client().head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc
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
        bucket, key = split_url(location)
        if size is None:
            size = self.stat(location).size
        return io.BufferedReader(_RangedObject(bucket, key, size), buffer_size=_READ_BLOCK)

    def read_bytes(self, location: str) -> bytes:
        bucket, key = split_url(location)
        try:
            return bytes(client().get_object(Bucket=bucket, Key=key)["Body"].read())
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc

    def read_range(self, location: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        bucket, key = split_url(location)
        try:
            body = client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
            return bytes(body.read())
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc

    def write_atomic(self, location: str, data: bytes) -> None:
        bucket, key = split_url(location)
        try:
            client().put_object(Bucket=bucket, Key=key, Body=data)
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc

    def delete(self, location: str) -> None:
        bucket, key = split_url(location)
        try:
            client().delete_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc

    def upload_file(self, local_path: str, location: str) -> None:
        """boto3's managed transfer: multipart above 8 MiB, parts in parallel; the object appears
        only once every part is there."""
        bucket, key = split_url(location)
        try:
            client().upload_file(local_path, bucket, key)
        except Exception as exc:
            # boto3 wraps the ClientError of a failed upload in S3UploadFailedError
            cause = exc.__context__ if type(exc).__name__ == "S3UploadFailedError" else None
            error = _translate(cause if isinstance(cause, Exception) else exc, bucket, key)
            if not isinstance(error, (OSError, InputError)):
                error = OSError(f"s3://{bucket}/{key}: upload failed: {exc}")
            raise error from exc

    def download_file(self, location: str, local_path: str) -> None:
        bucket, key = split_url(location)
        directory = os.path.dirname(local_path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        os.close(fd)
        try:
            client().download_file(bucket, key, tmp)
            os.replace(tmp, local_path)
        except Exception as exc:
            raise _translate(exc, bucket, key) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
