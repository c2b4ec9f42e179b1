"""How a prompt and its completion fit the model's context (the routes that use it run end to end
in tests/integration/test_openai_e2e.py and test_generate_e2e.py)."""

from __future__ import annotations

import pytest

from engine.errors import ContextLengthExceeded, InvalidInput
from engine.generation.context import completion_budget


def refused(prompt: int, max_tokens: int, *, requested: bool, chat: bool) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        completion_budget(prompt, max_tokens, 64, requested=requested, chat=chat)
    return caught.value


@pytest.mark.parametrize("requested", [False, True])
def test_a_completion_that_fits_is_kept(requested: bool) -> None:
    assert completion_budget(40, 24, 64, requested=requested) == 24  # exactly the context
    assert completion_budget(40, 5, 64, requested=requested) == 5


def test_max_tokens_not_requested_is_clamped_to_what_the_context_leaves() -> None:
    # The model's default max_tokens (or Triton's generate extension): finish reason `length`.
    assert completion_budget(58, 16, 64) == 6
    assert completion_budget(63, 1000, 64, chat=True) == 1


@pytest.mark.parametrize(
    ("chat", "message"),
    [
        (True, "This model's maximum context length is 64 tokens. However, you requested 70 "
               "tokens (40 in the messages, 30 in the completion). Please reduce the length of "
               "the messages or completion: after this prompt the completion may have at most "
               "24 tokens"),
        (False, "This model's maximum context length is 64 tokens. However, you requested 70 "
                "tokens (40 in your prompt; 30 for the completion). Please reduce your prompt "
                "or completion length: after this prompt the completion may have at most 24 "
                "tokens"),
    ],
)  # fmt: skip
def test_max_tokens_requested_past_the_context_is_refused_as_openai_words_it(
    chat: bool, message: str
) -> None:
    # It was clamped to 24 tokens whatever the API, where OpenAI and vLLM refuse it.
    error = refused(40, 30, requested=True, chat=chat)
    assert (error.message, type(error), error.param) == (message, ContextLengthExceeded, None)


@pytest.mark.parametrize("requested", [False, True])
@pytest.mark.parametrize(
    ("chat", "message"),
    [
        (True, "This model's maximum context length is 64 tokens. However, your messages "
               "resulted in 64 tokens. Please reduce the length of the messages: the context "
               "holds the prompt and the completion together, so a prompt may have at most 63 "
               "tokens"),
        (False, "This model's maximum context length is 64 tokens. However, your prompt "
                "resulted in 64 tokens. Please reduce your prompt: the context holds the prompt "
                "and the completion together, so a prompt may have at most 63 tokens"),
    ],
)  # fmt: skip
def test_a_prompt_that_leaves_no_room_is_refused_whatever_max_tokens(
    chat: bool, message: str, requested: bool
) -> None:
    error = refused(64, 1, requested=requested, chat=chat)
    assert (error.message, type(error)) == (message, ContextLengthExceeded)
