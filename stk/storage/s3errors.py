"""What an S3 error means in storage's terms: whether a retry may fix it (botocore's own classification), its
short reason for the log, and, where no retry can, the FileNotFoundError, OSError or InputError it is for the
one object or the bucket as a whole (one clear line naming the bucket and the endpoint)."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace

from stk.errors import InputError

__all__ = ["cause_of", "reason", "transient", "translate"]

_MISSING = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
_BODYLESS = {"HeadObject", "HeadBucket"}  # S3 answers these without an error document: their codes are numbers


def cause_of(exc: Exception) -> Exception:
    """The botocore error under boto3's transfer wrappers (RetriesExceededError, S3UploadFailedError)."""
    last = getattr(exc, "last_exception", None)
    if isinstance(last, Exception):
        return last
    if type(exc).__name__ == "S3UploadFailedError" and isinstance(exc.__context__, Exception):
        return exc.__context__
    return exc


def transient(exc: Exception) -> bool:
    """Whether a retry may fix it, by botocore's standard-mode rules: no connection, a timeout, a
    cut stream, HTTP 5xx or 429, a throttling or request-timeout code."""
    from botocore.exceptions import ClientError, IncompleteReadError
    from botocore.retries import standard

    if getattr(exc, "last_exception", None) is not None:
        return True  # s3transfer ran out of its attempts at socket errors it retries itself
    exc = cause_of(exc)
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        response = SimpleNamespace(status_code=status)
        context = standard.RetryContext(1, parsed_response=exc.response, http_response=response)
    elif isinstance(exc, (IncompleteReadError, ConnectionError, TimeoutError)):
        return True  # a body cut short, or a socket error below botocore
    else:
        context = standard.RetryContext(1, caught_exception=exc)
    checkers = [
        standard.TransientRetryableChecker(),
        standard.ThrottledRetryableChecker(),
        standard.ThrottlingStatusCodeChecker(),  # type: ignore[attr-defined]  # missing from the stubs
    ]
    return any(checker.is_retryable(context) for checker in checkers)


def reason(exc: Exception) -> str:
    """The failure in a few words for the log: its HTTP status and code, or botocore's message."""
    from botocore.exceptions import ClientError

    exc = cause_of(exc)
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"HTTP {status} {error.get('Code', '')}".strip()
    # botocore ends its messages with the URL; the endpoint is named beside the reason already
    return re.sub(r' (on|to|from) (the )?endpoint URL: ".*"$', "", str(exc)) or type(exc).__name__


def _not_s3(cause: Exception, endpoint: Callable[[], str]) -> InputError | None:
    """An InputError when an answer carries no S3 error document (its code is the bare HTTP status)
    to a request S3 always answers with one: the endpoint is some other HTTP server."""
    from botocore.exceptions import ClientError

    if not isinstance(cause, ClientError) or cause.operation_name in _BODYLESS:
        return None
    code = str(cause.response.get("Error", {}).get("Code", ""))
    if not code.isdigit():
        return None
    return InputError(
        f"S3 endpoint {endpoint()} does not answer as S3 (HTTP {code} to {cause.operation_name}, without an S3 "
        "error document): check --s3-endpoint-url (or AWS_ENDPOINT_URL)"
    )


def translate(exc: Exception, endpoint: Callable[[], str], bucket: str, key: str = "") -> Exception:
    """A botocore error that a retry cannot fix -> a FileNotFoundError/OSError for one object, or an
    InputError for the bucket as a whole (one clear line naming the bucket and the endpoint, which `endpoint`
    gives: called only for a message that names it)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    cause = cause_of(exc)
    foreign = _not_s3(cause, endpoint)
    if foreign is not None:
        return foreign
    if isinstance(cause, ClientError):
        code = str(cause.response.get("Error", {}).get("Code", ""))
        if code in _NO_BUCKET:
            return InputError(f"S3 bucket '{bucket}' does not exist at {endpoint()}")
        if code in _DENIED:
            return InputError(
                f"access denied to s3://{bucket}/{key} at {endpoint()} ({code}): check the credentials "
                "boto3 finds (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance role)"
            )
        if code in _MISSING:
            return FileNotFoundError(f"s3://{bucket}/{key}: no such object")
        return OSError(f"s3://{bucket}/{key}: S3 error {code}")
    if isinstance(cause, NoCredentialsError):
        return InputError(f"no S3 credentials found for bucket '{bucket}' at {endpoint()}")
    if isinstance(cause, BotoCoreError) or cause is not exc:
        return OSError(f"s3://{bucket}/{key}: {exc}")
    return exc
