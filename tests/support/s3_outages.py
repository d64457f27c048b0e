"""S3 outages for the fault tests: a SeaweedFS server of a test's own, stopped (SIGSTOP) or killed and started again on
the same ports and data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.weed_server import WeedServer


@pytest.fixture
def weed(tmp_path: Path) -> Iterator[WeedServer]:
    """A private S3 server that this test may stop, kill and restart."""
    server = WeedServer(tmp_path / "weed")
    server.data.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.kill()  # its data goes with tmp_path: no need to wait for a clean shutdown (2-15 s)


def _outage(weed: WeedServer, fault: str) -> None:
    if fault == "kill":
        weed.kill()
    else:
        weed.pause()


def _recover(weed: WeedServer, fault: str) -> None:
    if fault == "kill":
        weed.start()
    else:
        weed.resume()
