"""Server-sent events with JSON data."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
"""OpenAI's last event."""


def dumps(data: Any) -> bytes:
    """`data` as one line of JSON."""
    return orjson.dumps(data)


def event(data: Any) -> bytes:
    """One server-sent event whose data is `data` as JSON."""
    return b"data: " + dumps(data) + b"\n\n"
