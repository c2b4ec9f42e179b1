"""The OpenAI-compatible API's request checks (the routes run end to end in
tests/integration/test_openai_e2e.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from server.generating import GenerationCall, GenerationRoute
from server.http.openai import (
    _choices,
    _include_usage,
    _messages,
    _options,
    _prompts,
    _streamed,
)
from server.ledger import Ledger
from tests.unit.server.bodies import ANYONE, WRONG_KINDS, parsed


def choose(model: object) -> None:
    """The route's check of the model its body names; the caller is authenticated already
    (ANYONE): the check asks nothing of the engine."""
    ledger = Ledger(SimpleNamespace(tracing=None))  # type: ignore[arg-type]
    call = GenerationCall(ledger, GenerationRoute("http", "test", "test", {}), 0.0)
    call.caller = ANYONE
    call.choose(model)


PAST_64_BITS = [(2**64, "2^64 or more"), (2**70, "2^64 or more"), (-(2**64), "below -2^63")]


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
@pytest.mark.parametrize(
    ("key", "allowed", "check"),
    [
        ("n", "n must be an integer from 1 to 16", _choices),
        ("best_of", "best_of must be 1", _options),
    ],
)
def test_n_and_best_of_past_64_bits_are_named_by_their_side(
    key: str, allowed: str, check: Callable[[dict[str, Any]], object], value: int, shown: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        check(parsed(f'{{"{key}": {value}}}'))
    # Not the double's digits: 1.8446744073709552e+19.
    assert caught.value.message == f"{allowed}; got {shown}"


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
def test_an_unsupported_parameter_past_64_bits_is_named_by_its_side(value: int, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _options(parsed(f'{{"logprobs": {value}}}'))  # an integer in the completions API
    assert caught.value.message == (
        "logprobs is not supported by this server (the engines hand over tokens without their "
        f"probabilities); got {shown}"
    )


def test_n_and_best_of_other_values_are_shown_as_sent() -> None:
    with pytest.raises(InvalidInput, match=r"^n must be an integer from 1 to 16; got '1'$"):
        _choices({"n": "1"})
    with pytest.raises(InvalidInput, match=r"^n must be an integer from 1 to 16; got true$"):
        _choices({"n": True})
    with pytest.raises(InvalidInput, match=r"^best_of must be 1; got 2$"):
        _options({"best_of": 2})


@pytest.mark.parametrize(("value", "shown"), PAST_64_BITS)
def test_a_token_id_past_64_bits_goes_on_to_the_vocabulary_check(value: int, shown: str) -> None:
    # The service names it against the model's vocabulary, as any other id out of it; here it
    # was "prompt must be a string or a list of token ids".
    for body in (f'{{"prompt": [1, {value}]}}', f'{{"prompt": [[1, {value}]]}}'):
        assert _prompts(parsed(body)) == [[1, float(value)]]


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, "2"], [1, True], {"x": 1}, [[1], [2.5]]])
def test_other_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(InvalidInput, match=r"^prompt must be a string, a list of token ids"):
        _prompts({"prompt": prompt})


def test_a_list_of_prompts_keeps_its_order() -> None:
    assert _prompts({"prompt": "a"}) == ["a"]
    assert _prompts({"prompt": [5, 6]}) == [[5, 6]]
    assert _prompts({"prompt": ["b", "a", [3]]}) == ["b", "a", [3]]
    assert _prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]


def test_n_is_the_choices_of_each_prompt() -> None:
    assert _choices({}) == 1
    assert _choices({"n": None}) == 1
    assert _choices({"n": 16}) == 16
    for n in (0, 17, 2.0):
        with pytest.raises(InvalidInput):
            _choices({"n": n})


@pytest.mark.parametrize(
    ("value", "shown"),
    [(v, shown) for v, shown in WRONG_KINDS if v not in ("null", "true")] + [('"yes"', "'yes'")],
)
def test_a_stream_of_the_wrong_kind_is_named_as_sent(value: str, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _streamed(parsed(f'{{"stream": {value}}}'))
    assert caught.value.message == f"stream must be true or false; got {shown}"


def test_stream_null_or_absent_is_not_streamed() -> None:
    # OpenAI's stream is "boolean or null"; null asks for the default, as n: null does.
    assert _streamed({}) is False
    assert _streamed({"stream": None}) is False
    assert _streamed({"stream": True}) is True


@pytest.mark.parametrize(("value", "shown"), [*WRONG_KINDS, ('"banana"', "'banana'")])
def test_a_role_of_the_wrong_kind_is_named_as_sent(value: str, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _messages(parsed(f'{{"messages": [{{"role": {value}, "content": "hi"}}]}}'))
    assert caught.value.message == (
        f"messages[0].role must be one of system, developer, user, assistant, tool; got {shown}"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"messages": 18446744073709551616}',
         "messages must be a non-empty list of {role, content} objects; got 2^64 or more"),
        ('{"messages": []}',
         "messages must be a non-empty list of {role, content} objects; got []"),
        ('{"messages": [18446744073709551616]}',
         "messages[0] must be an object with role and content; got 2^64 or more"),
        ('{"messages": [{"role": "user", "content": 18446744073709551616}]}',
         "messages[0].content must be a string or a list of text parts ({type: text, text}); "
         "this model takes text only; got 2^64 or more"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
         "messages[0].content must be a string or a list of text parts ({type: text, text}); "
         "this model takes text only; got [{'type': 'image_url'}]"),
    ],
)  # fmt: skip
def test_messages_of_the_wrong_kind_are_named_as_sent(body: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _messages(parsed(body))
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ('{"prompt": 18446744073709551616}', "2^64 or more"),  # was "got float"
        ('{"prompt": 5}', "5"),  # was "got int"
        ('{"prompt": null}', "null"),  # was "got NoneType"
        ('{"prompt": {"x": 1}}', "{'x': 1}"),
        ('{"prompt": [1, 2.5]}', "[1, 2.5]"),
    ],
)
def test_a_prompt_of_the_wrong_kind_is_named_as_sent(body: str, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _prompts(parsed(body))
    assert caught.value.message == (
        f"prompt must be a string, a list of token ids, or a non-empty list of either; got {shown}"
    )


@pytest.mark.parametrize(
    ("value", "shown"), [(0, "0"), (-1, "-1"), (2.5, "2.5"), ("8", "'8'"), (2**64, "2^64 or more")]
)
def test_max_completion_tokens_out_of_range_is_named_as_sent(value: object, shown: str) -> None:
    # It means max_tokens, and was refused under that name, which the client never sent.
    text = str(value) if isinstance(value, int) else orjson.dumps(value).decode()
    body = parsed(f'{{"max_completion_tokens": {text}}}')  # 2^64 reaches it as a double
    with pytest.raises(InvalidInput, match=r"^max_completion_tokens must be ") as caught:
        _options(body)
    assert caught.value.message.endswith(f"; got {shown}")


def test_max_completion_tokens_stands_for_max_tokens() -> None:
    assert _options({"max_completion_tokens": 7})["max_tokens"] == 7
    assert _options({"max_completion_tokens": 7, "max_tokens": 5})["max_tokens"] == 5
    assert "max_tokens" not in _options({"max_completion_tokens": None})


@pytest.mark.parametrize(
    ("check", "body", "param"),
    [
        (_choices, {"n": 0}, "n"),
        (_options, {"best_of": 3}, "best_of"),
        (_options, {"logit_bias": {"1": 5}}, "logit_bias"),
        (_options, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (_prompts, {"prompt": 5}, "prompt"),
        (_messages, {"messages": []}, "messages"),
        (_messages, {"messages": ["hi"]}, "messages[0]"),
        (_messages, {"messages": [{"role": "user", "content": "a"}, {"role": "x"}]},
         "messages[1].role"),
        (_messages, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (_streamed, {"stream": "yes"}, "stream"),
        (lambda body: choose(body["model"]), {"model": 5}, "model"),
    ],
)  # fmt: skip
def test_a_refused_field_is_named_in_param(
    check: Callable[[dict[str, Any]], object], body: dict[str, Any], param: str
) -> None:
    # OpenAI's error object carries it as `param` (it was always null), nested as OpenAI names
    # nested fields.
    with pytest.raises(InvalidInput) as caught:
        check(body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("check", "body", "message"),
    [
        (_prompts, {}, "prompt is required: a string, a list of token ids, or a non-empty list "
         "of either"),
        (_messages, {}, "messages is required: a non-empty list of {role, content} objects"),
        (_messages, {"messages": [{"content": "hi"}]},
         "messages[0].role is required: one of system, developer, user, assistant, tool"),
        (_messages, {"messages": [{"role": "user"}]},
         "messages[0].content is required: a string or a list of text parts ({type: text, "
         "text}); this model takes text only"),
    ],
)  # fmt: skip
def test_a_required_field_left_out_is_named_as_missing(
    check: Callable[[dict[str, Any]], object], body: dict[str, Any], message: str
) -> None:
    # It read "got null", as if the client had sent null; an explicit null still reads so.
    with pytest.raises(InvalidInput) as caught:
        check(body)
    assert caught.value.message == message


def test_include_usage_is_read_from_stream_options() -> None:
    assert _include_usage({}, stream=True) is False
    assert _include_usage({"stream_options": None}, stream=False) is False
    assert _include_usage({"stream_options": {}}, stream=True) is False
    assert _include_usage({"stream_options": {"include_usage": None}}, stream=True) is False
    assert _include_usage({"stream_options": {"include_usage": True}}, stream=True) is True
    # Other keys (vLLM's continuous_usage_stats) are ignored, as unknown fields are.
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert _include_usage({"stream_options": options}, stream=True) is True


def test_stream_options_without_a_stream_is_refused_as_openai_refuses_it() -> None:
    with pytest.raises(InvalidInput) as caught:
        _include_usage({"stream_options": {"include_usage": True}}, stream=False)
    assert caught.value.message == "stream_options is only allowed when stream is true"
    assert caught.value.param == "stream_options"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("true", "stream_options must be an object such as {include_usage: true}; got true"),
        ('{"include_usage": 1}', "stream_options.include_usage must be true or false; got 1"),
    ],
)
def test_stream_options_of_the_wrong_kind_are_named_as_sent(options: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        _include_usage(parsed(f'{{"stream_options": {options}}}'), stream=True)
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [("modalities", ["text", "audio"], "['text', 'audio']"),
     ("audio", {"voice": "alloy", "format": "wav"}, "{'voice': 'alloy', 'format': 'wav'}"),
     ("web_search_options", {}, "{}")],
)  # fmt: skip
def test_output_this_server_cannot_produce_is_refused(key: str, value: object, shown: str) -> None:
    # Ignoring them would answer text where audio or a web search was asked for.
    with pytest.raises(InvalidInput) as caught:
        _options({key: value})
    assert caught.value.message == f"{key} is not supported by this server; got {shown}"
    assert _options({key: None, "modalities": ["text"]}) == {}


def test_fields_this_server_does_not_know_are_ignored() -> None:
    body = {"user": "u", "store": True, "metadata": {"a": "b"}, "service_tier": "auto",
            "parallel_tool_calls": True, "prompt_cache_key": "k", "novel": [1]}  # fmt: skip
    assert _options(body) == {}
