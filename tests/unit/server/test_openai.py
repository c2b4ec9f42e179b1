"""The OpenAI-compatible API's request checks (the routes run end to end in
tests/integration/test_openai_e2e.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from server.openai import _options, _prompt

PAST_64_BITS = [(2**64, "2^64 or more"), (2**70, "2^64 or more"), (-(2**64), "below -2^63")]


def parsed(body: str) -> dict[str, Any]:
    """A body as the route reads it: orjson hands an integer past 64 bits over as a double."""
    loaded: dict[str, Any] = orjson.loads(body)
    return loaded


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
@pytest.mark.parametrize(
    ("key", "allowed"),
    [("n", "n must be 1 (one choice per request)"), ("best_of", "best_of must be 1")],
)
def test_n_and_best_of_past_64_bits_are_named_by_their_side(
    key: str, allowed: str, value: int, shown: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        _options(parsed(f'{{"{key}": {value}}}'))
    # Not the double's digits: 1.8446744073709552e+19.
    assert caught.value.message == f"{allowed}; got {shown}"


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
def test_an_unsupported_parameter_past_64_bits_is_named_by_its_side(value: int, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _options(parsed(f'{{"logprobs": {value}}}'))  # an integer in the completions API
    assert caught.value.message == f"logprobs is not supported by this server; got {shown}"


def test_n_and_best_of_other_values_are_shown_as_sent() -> None:
    with pytest.raises(InvalidInput, match=r"^n must be 1 \(one choice per request\); got '1'$"):
        _options({"n": "1"})
    with pytest.raises(InvalidInput, match=r"^best_of must be 1; got 2$"):
        _options({"best_of": 2})


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
def test_a_token_id_past_64_bits_goes_on_to_the_vocabulary_check(value: int, shown: str) -> None:
    # The service names it against the model's vocabulary, as any other id out of it; here it
    # was "prompt must be a string or a list of token ids".
    for body in (f'{{"prompt": [1, {value}]}}', f'{{"prompt": [[1, {value}]]}}'):
        assert _prompt(parsed(body)) == [1, float(value)]


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, "2"], [1, True], {"x": 1}])
def test_other_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(InvalidInput, match=r"^prompt must be a string or a list of token ids"):
        _prompt({"prompt": prompt})
