"""Triton's generate extension's request checks (the routes run end to end in
tests/integration/test_generate_e2e.py)."""

from __future__ import annotations

import orjson
import pytest

from engine.errors import InvalidInput
from server.http.triton_generate import _request


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"text_input": null}', "text_input must be a string; got null"),
        (b'{"text_input": 5}', "text_input must be a string; got 5"),
        (
            b'{"text_input": ["a", "b"]}',
            "text_input must be one value (or a list of one); got ['a', 'b']",
        ),
        (b'{"text_input": [5]}', "text_input must be a string; got [5]"),
        (b'{"text_input": 18446744073709551616}', "text_input must be a string; got 2^64 or more"),
        (b'{"text_input": true}', "text_input must be a string; got true"),
        (b"[1]", "the request body must be a JSON object; got [1]"),
    ],
)
def test_a_body_or_text_input_of_the_wrong_kind_is_named_as_sent(body: bytes, message: str) -> None:
    # As JSON sent it: not Python's type names ('got NoneType', 'got float' for 2^64).
    with pytest.raises(InvalidInput) as caught:
        _request(orjson.loads(body))
    assert caught.value.message == message
