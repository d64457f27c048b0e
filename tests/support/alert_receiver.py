"""A local HTTP receiver for apprise json:// alerts."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """An HTTP server that records the JSON bodies POSTed to it: on 127.0.0.1, or on `host` (the
    four-node cluster's bridge address, which its nodes reach)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append({"path": self.path, **json.loads(self.rfile.read(length))})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.host, self.port = host, self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"json://{self.host}:{self.port}{path}"

    def events(self) -> list[str]:
        return [b["type"] for b in self.bodies]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
