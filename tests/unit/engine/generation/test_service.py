"""The generation service's prompt checks (the service runs end to end in
tests/integration/test_openai_e2e.py and test_generate_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from engine.generation.service import GenerateRequest, prompt_ids
from engine.generation.text import ModelText
from tests.generative import train_tokenizer


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """What prompt_ids reads of a Generator: its text, with the tiny GPT-2's tokenizer."""
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(folder)
    return SimpleNamespace(text=ModelText(folder))


async def rejected(generator: Any, prompt: object) -> str:
    with pytest.raises(InvalidInput) as caught:
        await prompt_ids(generator, prompt)
    return caught.value.message


async def test_token_ids_in_the_vocabulary_pass(generator: Any) -> None:
    last = generator.text.tokenizer.get_vocab_size() - 1
    assert await prompt_ids(generator, [0, 5, last]) == [0, 5, last]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(1_000_000, "1000000"), (-1, "-1"), (2**64, "2^64 or more"), (-(2**64), "below -2^63")],
)
async def test_a_token_id_out_of_the_vocabulary_is_named_with_its_range(
    generator: Any, value: int, shown: str
) -> None:
    # As JSON sends it: an id past 64 bits is a double, which was "prompt must be a string or a
    # list of token ids" (the double's digits would misstate it: 1.8446744073709552e+19).
    prompt = orjson.loads(f"[1, {value}]")
    last = generator.text.tokenizer.get_vocab_size() - 1
    assert await rejected(generator, prompt) == (
        f"prompt token {shown} is not in the vocabulary (0 to {last})"
    )


@pytest.mark.parametrize(
    ("prompt", "shown"),
    [([1, 2.5], "[1, 2.5]"), ([1, "2"], "[1, '2']"), ([1, None], "[1, null]"), (7, "7"),
     (orjson.loads("18446744073709551616"), "2^64 or more"), (None, "null")],
)  # fmt: skip
async def test_anything_else_is_no_prompt(generator: Any, prompt: object, shown: str) -> None:
    # Named as JSON sent it (it was Python's type name: float for an integer past 64 bits).
    assert await rejected(generator, prompt) == (
        f"prompt must be a string or a list of token ids (one prompt per request); got {shown}"
    )


@pytest.mark.parametrize("refuse", [False, True])
def test_a_request_crosses_the_wire_with_what_it_does_past_the_context(refuse: bool) -> None:
    # Under --workers the engine process checks the context: the OpenAI routes' refusal of a
    # max_tokens past it must reach it (GENERATE frames are orjson).
    request = GenerateRequest("tiny", None, prompt=[1, 2], options={"max_tokens": 9},
                              refuse_past_context=refuse)  # fmt: skip
    assert GenerateRequest.from_wire(orjson.loads(orjson.dumps(request.to_wire()))) == request


def test_a_request_from_a_worker_without_the_flag_clamps() -> None:
    wire: dict[str, Any] = {"model": "tiny", "tenant": None, "prompt": "a", "messages": None,
                            "options": {}}  # fmt: skip
    assert GenerateRequest.from_wire(wire).refuse_past_context is False
    with pytest.raises(TypeError, match="refuse_past_context must be true or false"):
        GenerateRequest.from_wire({**wire, "refuse_past_context": "yes"})
