"""server/http/connection_policy.py: the answers a connection sends by itself."""

from __future__ import annotations

import pytest

from server.http.connection_policy import REQUEST_TIMEOUT, TOO_MANY_CONNECTIONS


@pytest.mark.parametrize(
    ("answer", "status"), [(REQUEST_TIMEOUT, b"408"), (TOO_MANY_CONNECTIONS, b"503")]
)
def test_canned_answers_are_complete_http_responses(answer: bytes, status: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 " + status + b" ")
    fields = dict(line.split(b": ", 1) for line in lines[1:])
    assert fields[b"connection"] == b"close"
    assert int(fields[b"content-length"]) == len(body)
    assert body.startswith(b'{"error":"')
