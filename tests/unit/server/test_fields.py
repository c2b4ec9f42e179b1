"""server.fields: a refused request field is a 400 naming the field and showing what was sent."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import InvalidInput
from server.errors import http_status
from server.fields import ABSENT, refused


def test_a_field_left_out_is_required() -> None:
    exc = refused("model", "a string", ABSENT)
    assert isinstance(exc, InvalidInput)
    assert exc.message == "model is required: a string"
    assert exc.param == "model"
    assert http_status(exc) == 400


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "null"),  # an explicit null is not a field left out
        (True, "true"),
        ("hot", "'hot'"),
        (2, "2"),
        ([1, 2], "[1, 2]"),
        ({"a": 1}, "{'a': 1}"),
    ],
)
def test_a_value_is_shown_as_it_was_sent(value: Any, shown: str) -> None:
    exc = refused("temperature", "a number from 0 to 2", value)
    assert exc.message == f"temperature must be a number from 0 to 2; got {shown}"
    assert exc.param == "temperature"


def test_a_long_value_is_cut() -> None:
    exc = refused("stop", "a string or a list of strings", "x" * 1000)
    assert exc.message.endswith("...")
    assert len(exc.message) < 200
