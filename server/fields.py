"""A request field refused (`refused`, `ABSENT`): a precise 400 naming the field (OpenAI's error
object carries it as `param`) and showing the value as it was sent.

The OpenAI routes (server/http/openai.py, openai_tools.py, embeddings.py) refuse their fields
with it, and the data plane the model a generation names (server/dataplane.py)."""

from __future__ import annotations

from engine.datatypes import received
from engine.errors import InvalidInput

ABSENT = object()
"""What `body.get(key, ABSENT)` gives for a field the request left out: refused as missing,
where an explicit null is refused as null."""


def refused(param: str, allowed: str, value: object) -> InvalidInput:
    """InvalidInput for request field `param`, which must be `allowed`: "<param> must be
    <allowed>; got <value as sent>", or "<param> is required: <allowed>" when it was left out."""
    if value is ABSENT:
        return InvalidInput(f"{param} is required: {allowed}", param)
    return InvalidInput(f"{param} must be {allowed}; got {received(value)}", param)
