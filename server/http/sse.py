"""Server-sent events with JSON data, safe for every line-based reader.

JSON escapes control characters (\\n, \\r, \\x0b, \\x0c, \\x1c-\\x1e among them) but lets other
characters through as UTF-8, and some readers split lines on more than the SSE line ends: Python's
`str.splitlines` (which httpx's `aiter_lines` uses) breaks at U+0085 (next line), U+2028 (line
separator) and U+2029 (paragraph separator), and JavaScript before ES2019 could not parse the last
two inside strings. A token that decodes to one of them cut an event in two. Here they are written
as JSON escapes (`\\u0085`), which every JSON parser reads back to the same character, so an event
is exactly one line whatever text it carries."""

from __future__ import annotations

from typing import Any

import orjson

# Their UTF-8 encodings never occur inside another character's (UTF-8 is self-synchronizing), so
# replacing the bytes replaces exactly those characters.
_LINE_BREAKS = [(ch.encode(), f"\\u{ord(ch):04x}".encode()) for ch in "\x85\u2028\u2029"]

DONE = b"data: [DONE]\n\n"
"""OpenAI's last event."""


def dumps(data: Any) -> bytes:
    """`data` as one line of JSON: orjson's, with the characters above escaped."""
    payload = orjson.dumps(data)
    for raw, escaped in _LINE_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return payload


def event(data: Any) -> bytes:
    """One server-sent event whose data is `data` as JSON."""
    return b"data: " + dumps(data) + b"\n\n"
