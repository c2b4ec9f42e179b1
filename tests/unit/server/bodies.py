"""What the generation front-ends' request-check tests share (test_generation.py,
http/test_openai.py): a body as a route reads it, JSON values of the wrong kind that a refused
field must name as sent, and the caller as authenticated before the body is read."""

from __future__ import annotations

from typing import Any

import orjson

from engine.auth import ANONYMOUS_TENANT, Principal

ANYONE = Principal(ANONYMOUS_TENANT, "admin")  # the caller as authenticated before the body


def parsed(body: str) -> dict[str, Any]:
    """A body as the route reads it: orjson hands an integer past 64 bits over as a double."""
    loaded: dict[str, Any] = orjson.loads(body)
    return loaded


# Fields of the wrong JSON type are named as sent: an integer past 64 bits by its side (not the
# double's digits, 1.8446744073709552e+19, nor "float"), null/true/false as JSON spells them.
WRONG_KINDS = [
    ("18446744073709551616", "2^64 or more"),
    ("-18446744073709551616", "below -2^63"),
    ("null", "null"),
    ("true", "true"),
    ("5", "5"),
    ("2.5", "2.5"),
    ('["tiny", 18446744073709551616]', "['tiny', 2^64 or more]"),
    ('{"a": null}', "{'a': null}"),
]
