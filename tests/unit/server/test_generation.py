"""The check every generation request passes before it runs (server/generation.py's `caller`);
the routes that call it are tested in http/test_openai.py, http/test_triton_generate.py and
grpc/test_stream.py."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput
from server.generation import caller
from tests.unit.server.bodies import ANYONE, WRONG_KINDS, parsed


@pytest.mark.parametrize(("value", "shown"), WRONG_KINDS)
def test_a_model_of_the_wrong_kind_is_named_as_sent(value: str, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        caller(None, ANYONE, parsed(f'{{"model": {value}}}')["model"])  # type: ignore[arg-type]
    assert caught.value.message == f"model must be a model name (string); got {shown}"
