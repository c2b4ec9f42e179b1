"""A scripted HTTP/1.1 replica: answers every request with a status and headers set by the test."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson


class ScriptedReplica:
    """An HTTP/1.1 keep-alive server answering every request with `status` and `headers`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.headers: dict[str, str] = {}
        self.hits = 0
        self.peers: set[int] = set()
        self.seen_headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                with replica._lock:
                    replica.hits += 1
                    replica.peers.add(self.client_address[1])
                    replica.seen_headers.append(dict(self.headers))
                body = orjson.dumps({"replica": replica.name})
                self.send_response(replica.status)
                for key, value in replica.headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = _answer
            do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self._thread.join()
