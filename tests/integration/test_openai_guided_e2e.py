"""Structured output, tools, n and prompt lists through the official `openai` client against a
real `sluice serve` with the tiny GQA Llama on onnxruntime-genai (tests/genai_models.py).

Its weights are random: only guided decoding can make its answers valid JSON, so every answer
here that parses and matches its schema is the grammar's doing. Its chat template is replaced
by one that renders the names of `tools` and an assistant's `tool_calls` (briefly: the context
is 128 tokens), so the prompt's token count shows what the template was given."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import ServerProcess

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %} call "
    "{{ call.function.name }} {{ call.function.arguments | tojson }}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_genai_built: tuple[Path, Path]
) -> Iterator[tuple[ServerProcess, Path]]:
    from tests.genai_models import publish_genai

    root = tmp_path_factory.mktemp("guided")
    config = "generative:\n  max_running_sequences: 4\n  max_waiting_sequences: 16\n"
    version = publish_genai(tiny_genai_built[1], root / "models", config=config)
    (version / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    process = ServerProcess(
        "--model-repository", str(root / "models"), log_path=root / "server.log", grpc=False
    ).start(timeout_s=90)
    yield process, version
    process.stop()


def client(server: ServerProcess) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def matches_person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "member", "tier"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and type(value["age"]) is int
        and 0 <= value["age"] <= 150
        and type(value["member"]) is bool
        and value["tier"] in ("gold", "silver")
    )


def matches_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return (
        set(value) == {"city", "days"}
        and isinstance(value["city"], str)
        and len(value["city"]) <= 8
        and type(value["days"]) is int
        and 1 <= value["days"] <= 7
    )


def streamed_content(stream: Any) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_match_the_schema_streamed_and_not(
    served: tuple[ServerProcess, Path], temperature: float
) -> None:
    server, _ = served
    form = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for _ in range(3):
        answer = client(server).chat.completions.create(
            model="llama",
            messages=ASK,
            response_format=form,
            max_tokens=80,
            temperature=temperature,
        )
        assert answer.choices[0].finish_reason == "stop"
        assert matches_person(json.loads(answer.choices[0].message.content)), answer
        text, finish = streamed_content(
            client(server).chat.completions.create(
                model="llama",
                messages=ASK,
                response_format=form,
                max_tokens=80,
                temperature=temperature,
                stream=True,
            )
        )
        assert finish == "stop"
        assert matches_person(json.loads(text)), text


def test_json_object_answers_a_json_object_on_completions_too(
    served: tuple[ServerProcess, Path],
) -> None:
    """A JSON object with free keys may run past max_tokens (finish length, cut short, as
    OpenAI's are): it begins as one. One that ends is a whole object."""
    server, _ = served
    finished = 0
    for prompt in ["a", "the quick brown fox", "a prompt goes in", "the server"]:
        for path, key in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
            given = prompt if key == "prompt" else [{"role": "user", "content": prompt}]
            body = {
                "model": "llama",
                key: given,
                "max_tokens": 60,
                "temperature": 0,
                "response_format": {"type": "json_object"},
            }
            choice = httpx.post(f"{server.url}{path}", json=body, timeout=30).json()["choices"][0]
            text = choice["text"] if key == "prompt" else choice["message"]["content"]
            assert text.startswith("{"), text
            if choice["finish_reason"] == "stop":
                finished += 1
                assert isinstance(json.loads(text), dict), text
    assert finished > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(
    served: tuple[ServerProcess, Path], stream: bool
) -> None:
    server, _ = served
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    body = {
        "model": "llama",
        "messages": ASK,
        "max_tokens": 5,
        "stream": stream,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": schema},
        },
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format: the guided decoding cannot compile it")
    assert "/definitions/missing" in error["message"]
    # The server goes on: the next request is answered.
    body |= {"response_format": {"type": "json_object"}, "stream": False}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_or_named_tool_is_called_with_arguments_matching_its_schema(
    served: tuple[ServerProcess, Path], choice: Any, stream: bool
) -> None:
    server, _ = served
    tools = [WEATHER] if choice == "required" else [TIME, WEATHER]
    answer = client(server).chat.completions.create(
        model="llama",
        messages=ASK,
        tools=tools,
        tool_choice=choice,
        max_tokens=60,
        temperature=0,
        stream=stream,
    )
    if stream:
        chunks = [c for c in answer if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert not any(c.choices[0].delta.content for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.index, tc.type) for tc in calls] == [(0, "function")]
        call, finish = calls[0], chunks[-1].choices[0].finish_reason
    else:
        message = answer.choices[0].message
        assert message.content is None
        assert len(message.tool_calls) == 1
        call, finish = message.tool_calls[0], answer.choices[0].finish_reason
    assert finish == "tool_calls"
    assert call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert matches_weather(call.function.arguments), call.function.arguments


def test_auto_answers_text_or_a_call_matching_a_tool(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    seen = {"call": 0, "text": 0}
    for prompt in ["the quick brown fox", "a prompt goes in", "{", "the server answers"]:
        messages = [{"role": "user", "content": prompt}]
        answer = client(server).chat.completions.create(
            model="llama",
            messages=messages,
            tools=[WEATHER, TIME],
            n=8,
            max_tokens=60,
            temperature=1.0,
        )
        for choice in answer.choices:
            if choice.message.tool_calls:
                seen["call"] += 1
                assert choice.finish_reason == "tool_calls"
                assert choice.message.content is None
                call = choice.message.tool_calls[0].function
                assert call.name in ("get_weather", "get_time")
                if call.name == "get_weather":
                    assert matches_weather(call.arguments)
                else:
                    assert json.loads(call.arguments)["zone"] in ("utc", "local")
            else:
                seen["text"] += 1
                # Text never begins with `{`, unless a call was cut short by max_tokens.
                text = choice.message.content or ""
                assert not text.startswith("{") or choice.finish_reason == "length", text
    # Every answer was one of the two. The tiny model rarely opens with `{` by itself: the
    # call branch runs in tests/unit/server/http/test_openai_tools.py, its stream with fakes
    # in test_openai_choices.py.
    assert seen["call"] + seen["text"] == 32


def test_a_tool_call_round_trips_through_a_history(served: tuple[ServerProcess, Path]) -> None:
    from transformers import AutoTokenizer

    server, version = served
    first = client(server).chat.completions.create(
        model="llama",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client(server).chat.completions.create(
        model="llama", messages=history, tools=[WEATHER], max_tokens=5, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt is the template's rendering of the history and the tools, as transformers
    # renders it (arguments as an object, content null as empty).
    tokenizer = AutoTokenizer.from_pretrained(version)
    rendered_history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    **call.model_dump(),
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        history[2],
    ]
    text = tokenizer.apply_chat_template(
        rendered_history, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert f"call get_weather {json.dumps(json.loads(call.function.arguments))}" in text
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(ids)


def test_n_and_a_list_of_prompts_index_the_choices_in_order(
    served: tuple[ServerProcess, Path],
) -> None:
    server, _ = served
    prompts = ["the quick brown fox", "a prompt goes in"]
    singles = [
        client(server).completions.create(model="llama", prompt=p, max_tokens=8, temperature=0)
        for p in prompts
    ]
    answer = client(server).completions.create(
        model="llama", prompt=prompts, n=3, max_tokens=8, temperature=0
    )
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [
        s.choices[0].text for s in singles for _ in range(3)
    ]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert answer.usage.completion_tokens == 3 * sum(s.usage.completion_tokens for s in singles)
    stream = client(server).completions.create(
        model="llama",
        prompt=prompts,
        n=3,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = [""] * 6
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in answer.choices]
    assert usage is not None
    assert usage.completion_tokens == answer.usage.completion_tokens


def test_n_chat_choices_are_each_guided(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = client(server).chat.completions.create(
        model="llama", messages=ASK, n=4, response_format=form, max_tokens=80, temperature=1.0
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(matches_person(json.loads(c.message.content)) for c in answer.choices)


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"n": 17}, "n must be an integer from 1 to 16; got 17", "n"),
        ({"prompt": ["a"] * 9, "n": 2}, "9 prompts with n 2 ask for 18 choices", "n"),
        ({"prompt": ["a", 3]}, "prompt must be a string, a list of token ids", "prompt"),
        ({"logprobs": 2}, "logprobs is not supported", "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported", "presence_penalty"),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type must be text, json_object",
            "response_format.type",
        ),
    ],
)
def test_what_it_cannot_honour_is_a_400_naming_it(
    served: tuple[ServerProcess, Path], extra: dict[str, Any], message: str, param: str
) -> None:
    server, _ = served
    body = {"model": "llama", "prompt": "a", "max_tokens": 2} | extra
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == param
