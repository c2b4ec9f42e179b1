"""Structured output and tools as guidance, and answers read back as tool calls (the guided
decoding itself runs in tests/integration/test_openai_guided_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from server.http.openai_tools import history_message, response_guidance, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def schema_of(guidance: list[str]) -> Any:
    assert guidance[0] == "json_schema"
    return orjson.loads(guidance[1])


def test_text_asks_for_no_guidance() -> None:
    assert response_guidance({}) is None
    assert response_guidance({"response_format": None}) is None
    assert response_guidance({"response_format": {"type": "text"}}) is None


def test_json_object_and_json_schema_guide_compact_json() -> None:
    guidance = response_guidance({"response_format": {"type": "json_object"}})
    assert guidance is not None
    assert schema_of(guidance) == {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"name": "s", "schema": schema, "strict": True}
    guidance = response_guidance({"response_format": {"type": "json_schema", "json_schema": spec}})
    assert guidance is not None
    assert schema_of(guidance) == schema | {"x-guidance": {"whitespace_flexible": False}}
    # A schema that says how it wants its whitespace keeps it.
    own = schema | {"x-guidance": {"whitespace_flexible": True}}
    spec = {"name": "s", "schema": own}
    guidance = response_guidance({"response_format": {"type": "json_schema", "json_schema": spec}})
    assert guidance is not None
    assert schema_of(guidance) == own


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": []}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_response_format_of_the_wrong_shape_is_named(form: object, param: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        response_guidance({"response_format": form})
    assert caught.value.param == param


def test_no_tools_or_tool_choice_none_plans_no_call() -> None:
    assert tool_plan({}) is None
    assert tool_plan({"tools": [], "tool_choice": "auto"}) is None
    assert tool_plan({"tools": [WEATHER], "tool_choice": "none"}) is None


def test_required_guides_to_a_call_of_any_tool() -> None:
    plan = tool_plan({"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    assert plan is not None
    assert plan.mode == "required"
    calls = schema_of(plan.guidance)["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "weather"}, {"const": "clock"}]
    assert calls[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert calls[1]["properties"]["arguments"] == {"type": "object"}  # no parameters given


def test_a_named_tool_narrows_the_grammar_to_it() -> None:
    choice = {"type": "function", "function": {"name": "clock"}}
    plan = tool_plan({"tools": [WEATHER, CLOCK], "tool_choice": choice})
    assert plan is not None
    assert plan.mode == "required"
    assert plan.names == {"clock"}
    assert [c["properties"]["name"] for c in schema_of(plan.guidance)["anyOf"]] == [
        {"const": "clock"}
    ]


def test_auto_lets_the_first_character_choose_a_call_or_text() -> None:
    plan = tool_plan({"tools": [WEATHER]})
    assert plan is not None
    assert plan.mode == "auto"
    kind, grammar = plan.guidance
    assert kind == "lark_grammar"
    assert grammar.startswith("start: call | text\ncall: %json {")
    assert grammar.endswith("text: /([^{](.|\\n)*)?/\n")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": "weather"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_tools_of_the_wrong_shape_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        tool_plan(body)
    assert caught.value.param == param


def test_an_answer_is_read_back_as_a_call_only_when_it_is_a_whole_call() -> None:
    plan = tool_plan({"tools": [WEATHER, CLOCK]})
    assert plan is not None
    calls = plan.calls('{"name":"weather","arguments":{"city":"Oslo"}}')
    assert calls is not None
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city":"Oslo"}'}
    assert plan.calls("it is sunny") is None  # text, under auto
    assert plan.calls('{"name":"weather","argu') is None  # cut short by max_tokens
    assert plan.calls('{"name":"other","arguments":{}}') is None
    # A number JSON allows past a double's range is kept as generated.
    big = plan.calls('{"name":"clock","arguments":{"t":521E2982472}}')
    assert big is not None
    assert big[0]["function"]["arguments"] == '{"t":521E2982472}'
    spaced = plan.calls('{ "name": "clock", "arguments": {"t": 1} }')
    assert spaced is not None
    assert spaced[0]["function"]["arguments"] == '{"t":1}'


def test_an_assistant_tool_call_in_a_history_is_ready_for_the_template() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    ready = history_message(0, message)
    assert ready is not None
    assert ready["content"] == ""
    assert ready["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert ready["tool_calls"][0]["id"] == "call_1"
    # Arguments that are not JSON go to the template as they came.
    odd = {**call, "function": {"name": "weather", "arguments": "city=Oslo"}}
    ready = history_message(0, {"role": "assistant", "tool_calls": [odd]})
    assert ready is not None
    assert ready["tool_calls"][0]["function"]["arguments"] == "city=Oslo"
    assert history_message(0, {"role": "user", "content": "hi"}) is None
    with pytest.raises(InvalidInput) as caught:
        history_message(3, {"role": "assistant", "tool_calls": [{"function": {}}]})
    assert caught.value.param == "messages[3].tool_calls[0]"


async def test_the_auto_grammar_s_call_branch_decodes_to_a_call(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    """The tiny model never opens with `{` by itself: the auto grammar with its text branch
    left out runs the same `%json` call on the Engine, and reads back as a call."""
    from engine.generation.genai import GenaiGenerator
    from engine.generation.sampling import sampling_params

    plan = tool_plan({"tools": [WEATHER, CLOCK]})
    assert plan is not None
    kind, grammar = plan.guidance
    call_only = grammar.replace("start: call | text\n", "start: call\n")
    assert call_only != grammar
    gen = GenaiGenerator(tiny_genai_built[1], None, "llama")
    try:
        ids = await gen.prompt_ids("the quick brown fox")
        params = sampling_params(max_tokens=100, temperature=0, guidance=[kind, call_only])
        chunks = [c async for c in gen.start(ids, params).stream()]
    finally:
        await gen.close()
    assert chunks[-1].finish_reason == "stop"
    text = "".join(c.text for c in chunks)
    calls = plan.calls(text)
    assert calls is not None
    assert calls[0]["function"]["name"] in ("weather", "clock")
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
