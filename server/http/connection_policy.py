"""What every connection of one HTTP server obeys (the `http_*` settings), and the answers a
connection sends by itself, before or instead of any app's (server/http/connection.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.settings import Settings


def _canned(status: bytes, extra: bytes = b"") -> bytes:
    body = b'{"error":"' + status.split(b" ", 1)[1].lower() + b'"}'
    return b"".join(
        [
            b"HTTP/1.1 ",
            status,
            b"\r\ncontent-type: application/json\r\nconnection: close\r\n",
            extra,
            b"content-length: ",
            str(len(body)).encode(),
            b"\r\n\r\n",
            body,
        ]
    )


REQUEST_TIMEOUT = _canned(b"408 Request Timeout")
TOO_MANY_CONNECTIONS = _canned(b"503 Too many connections", b"retry-after: 1\r\n")


@dataclass(slots=True)
class ConnectionPolicy:
    """What every connection of one HTTP server obeys; `draining` is flipped at shutdown."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_pipelined: int = 16
    write_buffer_bytes: int = 64 * 1024
    write_timeout_s: float = 30.0
    draining: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionPolicy:
        """The policy the `http_*` settings describe."""
        return cls(
            settings.http_header_timeout_s,
            settings.http_body_timeout_s,
            settings.http_max_connections,
            settings.http_max_pipelined_requests,
            settings.http_write_buffer_bytes,
            settings.http_write_timeout_s,
        )
