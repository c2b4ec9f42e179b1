"""The OpenAI-compatible API end to end: a real `sluice serve` with the tiny GPT-2 converted by
`sluice convert`, called with httpx and the real `openai` client. Greedy completions must be
token-identical to transformers `generate`; bad input gets OpenAI's error object."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.generative import (
    CHAT_TEMPLATE,
    SENTENCES,
    copy_tiny,
    publish_tiny,
    reference_greedy,
    tiny_gpt2,
)
from tests.integration.helpers_e2e import Key, write_settings
from tests.servers import ServerProcess


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]
) -> Iterator[tuple[ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("openai")
    copy_tiny(tiny_gpt2_built, root)
    process = ServerProcess(
        "--model-repository", str(root / "models"), log_path=root / "server.log", grpc=False
    ).start(timeout_s=90)
    yield process, root / "hf"
    process.stop()


def tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def expected(folder: Path, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) the server must answer for greedy `ids`."""
    tokens = reference_greedy(folder, ids, max_tokens)
    finish = "length"
    if 0 in tokens:  # the end-of-text token ends it and is not counted as text
        tokens, finish = tokens[: tokens.index(0)], "stop"
    return tokenizer(folder).decode(tokens), len(tokens), finish


def chat_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of a chat: the tiny model's template rendered as the server renders it."""
    import jinja2

    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    rendered = template.render(messages=messages, add_generation_prompt=True)
    ids: list[int] = tokenizer(folder).encode(rendered).ids
    return ids


def events(body: str) -> list[Any]:
    lines = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_models_lists_the_generative_model(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    body = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["object"] == "list"


def test_greedy_completion_matches_transformers(served: tuple[ServerProcess, Path]) -> None:
    server, folder = served
    prompt = "the quick brown fox"
    ids = tokenizer(folder).encode(prompt).ids
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    text, count, finish = expected(folder, ids, 20)
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == finish
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": count,
        "total_tokens": len(ids) + count,
    }
    assert body["object"] == "text_completion"


def test_streamed_completion_is_the_same_text_with_usage_when_asked(
    served: tuple[ServerProcess, Path],
) -> None:
    server, folder = served
    ids = tokenizer(folder).encode(SENTENCES[1]).ids
    body = {"model": "tiny", "prompt": ids, "max_tokens": 25, "temperature": 0, "stream": True}
    text, count, finish = expected(folder, ids, 25)
    for options in (None, {}, {"include_usage": False}, {"include_usage": True}):
        asked = {**body, "stream_options": options} if options is not None else body
        reply = httpx.post(f"{server.url}/v1/completions", json=asked, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"].startswith("text/event-stream")
        chunks = events(reply.text)
        with_usage = options == {"include_usage": True}
        if with_usage:
            # OpenAI's stream_options: usage null on every chunk, then a chunk with no choices.
            *chunks, last = chunks
            assert last["choices"] == []
            assert last["usage"] == {"prompt_tokens": len(ids), "completion_tokens": count,
                                     "total_tokens": len(ids) + count}  # fmt: skip
            assert (last["id"], last["object"]) == (chunks[0]["id"], "text_completion")
            assert all(c["usage"] is None for c in chunks)
        else:
            assert all("usage" not in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == finish
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_sixteen_concurrent_streams_are_all_correct(served: tuple[ServerProcess, Path]) -> None:
    server, folder = served
    cases = []
    for i in range(16):
        ids = tokenizer(folder).encode(" ".join(SENTENCES[: i % 4 + 1])).ids[: 4 + i * 2]
        cases.append((ids, 6 + (i * 5) % 30))

    async def one(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> str:
        body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}  # fmt: skip
        reply = await client.post(f"{server.url}/v1/completions", json=body, timeout=60)
        return "".join(c["choices"][0]["text"] for c in events(reply.text))

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, ids, n) for ids, n in cases))

    texts = asyncio.run(run())
    for (ids, max_tokens), text in zip(cases, texts, strict=True):
        assert text == expected(folder, ids, max_tokens)[0], (ids, max_tokens)


def test_openai_client_chat_completion_uses_the_chat_template(
    served: tuple[ServerProcess, Path],
) -> None:
    from openai import OpenAI

    server, folder = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "a prompt goes in"}]
    ids = chat_ids(folder, messages)
    text, count, finish = expected(folder, ids, 15)
    answer = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=15,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == finish
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == count
    streamed = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=15,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    parts = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
    assert "".join(parts) == text
    with_usage = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=15, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *content, last = with_usage
    assert "".join(c.choices[0].delta.content or "" for c in content) == text
    assert all(c.usage is None for c in content)
    assert (last.choices, last.object) == ([], "chat.completion.chunk")
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), count)


def test_openai_client_completion_with_seed_repeats(served: tuple[ServerProcess, Path]) -> None:
    from openai import OpenAI

    server, _ = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    runs = [
        client.completions.create(
            model="tiny", prompt="tokens stream", max_tokens=10, temperature=1.2, top_p=0.9,
            seed=seed,
        ).choices[0].text
        for seed in (7, 7)
    ]  # fmt: skip
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("body", "status", "message", "param"),
    [
        ({"model": "tiny", "prompt": [5] * 70, "max_tokens": 3}, 400,
         "This model's maximum context length is 64 tokens. However, your prompt resulted in 70 "
         "tokens", None),
        # OpenAI's 404 for an unknown model has a null param too (its code is model_not_found).
        ({"model": "nope", "prompt": "a"}, 404, "unknown model 'nope'", None),
        ({"model": "tiny", "prompt": "a", "temperature": 5}, 400,
         "temperature must be from 0 to 2; got 5", "temperature"),
        ({"model": "tiny", "prompt": "a", "top_p": 2}, 400, "top_p must be from 0 to 1", "top_p"),
        ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens must be from 1",
         "max_tokens"),
        ({"model": "tiny", "prompt": "a", "max_completion_tokens": 0}, 400,
         "max_completion_tokens must be from 1", "max_completion_tokens"),
        ({"model": "tiny", "prompt": {"x": 1}}, 400, "prompt must be a string, a list",
         "prompt"),
        ({"model": "tiny", "prompt": [1, 10**6]}, 400,
         "prompt token 1000000 is not in the vocabulary (0 to 394)", "prompt"),
        # Integers past 64 bits (the parser reads them as doubles) are named by their side, not
        # by the double's digits (1.8446744073709552e+19) nor as a wrong kind.
        ({"model": "tiny", "prompt": [1, 2**64]}, 400,
         "prompt token 2^64 or more is not in the vocabulary (0 to 394)", "prompt"),
        ({"model": "tiny", "prompt": "a", "n": 2**64}, 400,
         "n must be an integer from 1 to 16; got 2^64 or more", "n"),
        ({"model": "tiny", "prompt": "a", "best_of": -(2**64)}, 400,
         "best_of must be 1; got below -2^63", "best_of"),
        # So are fields of the wrong kind (they showed the double's digits or Python's None).
        ({"model": 2**64, "prompt": "a"}, 400,
         "model must be a model name (string); got 2^64 or more", "model"),
        ({"model": None, "prompt": "a"}, 400, "model must be a model name (string); got null",
         "model"),
        # A required field left out is named as missing, not as the null it never sent.
        ({"prompt": "a"}, 400, "model is required: a model name (string)", "model"),
        ({"model": "tiny"}, 400,
         "prompt is required: a string, a list of token ids, or a non-empty list of either",
         "prompt"),
        ({"model": "tiny", "prompt": "a", "stream": -(2**64)}, 400,
         "stream must be true or false; got below -2^63", "stream"),
        ({"model": "tiny", "prompt": 2**64}, 400,
         "prompt must be a string, a list of token ids, or a non-empty list of either; "
         "got 2^64 or more", "prompt"),
        ({"model": "tiny", "prompt": "a", "stop": [2**64]}, 400,
         "stop must be a string or a list of strings; got [2^64 or more]", "stop"),
        ({"model": "tiny", "prompt": "a", "logprobs": 5}, 400,
         "logprobs is not supported by this server (the engines hand over tokens without their "
         "probabilities); got 5", "logprobs"),
        ({"model": "tiny", "prompt": "a", "echo": True}, 400, "echo is not supported", "echo"),
        ({"model": "tiny", "prompt": "a", "suffix": "X"}, 400, "suffix is not supported",
         "suffix"),
        ({"model": "tiny", "prompt": "a", "presence_penalty": 50}, 400,
         "presence_penalty is not supported", "presence_penalty"),
    ],
)  # fmt: skip
def test_bad_input_is_an_openai_error_object(
    served: tuple[ServerProcess, Path],
    body: dict[str, Any],
    status: int,
    message: str,
    param: str | None,
) -> None:
    server, _ = served
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def test_the_openai_client_sees_the_field_at_fault(served: tuple[ServerProcess, Path]) -> None:
    from openai import BadRequestError, OpenAI

    server, _ = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="a", temperature=5)
    assert refused.value.param == "temperature"
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}, {"role": "banana", "content": "x"}],  # type: ignore[list-item,misc]
        )
    assert refused.value.param == "messages[1].role"


LONG_CHAT = [{"role": "user", "content": "the lazy dog " * 30}]  # past the 64-token context
SHORT_CHAT = [{"role": "user", "content": "a prompt goes in"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        # As OpenAI answers them: its unknown model is an invalid_request_error (it was
        # not_found_error), code model_not_found; a chat past the context names messages.
        ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, None, "model_not_found"),
        ("/v1/chat/completions", {"model": "nope", "messages": LONG_CHAT}, 404, None,
         "model_not_found"),
        ("/v1/chat/completions", {"model": "tiny", "messages": LONG_CHAT}, 400, "messages",
         "context_length_exceeded"),
        ("/v1/chat/completions", {"model": "tiny", "messages": LONG_CHAT, "stream": True}, 400,
         "messages", "context_length_exceeded"),
        # So is one whose max_tokens the context cannot hold after the messages (it was a 200).
        ("/v1/chat/completions", {"model": "tiny", "messages": SHORT_CHAT, "max_tokens": 60},
         400, "messages", "context_length_exceeded"),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": SHORT_CHAT, "max_completion_tokens": 60, "stream": True},
         400, "messages", "context_length_exceeded"),
        # OpenAI's completions answer a prompt past the context with neither.
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 70}, 400, None, None),
        ("/v1/completions", {"model": "tiny", "prompt": [9] * 58, "max_tokens": 500}, 400, None,
         None),
        ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 5}, 400,
         "temperature", None),
    ],
)  # fmt: skip
def test_an_error_has_openai_code_and_type(
    served: tuple[ServerProcess, Path],
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    server, _ = served
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=10)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_the_openai_client_sees_the_code(served: tuple[ServerProcess, Path]) -> None:
    # LangChain and others tell context overflow by err.code (it was always None).
    from openai import BadRequestError, NotFoundError, OpenAI

    server, _ = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=LONG_CHAT)  # type: ignore[arg-type]
    assert (refused.value.code, refused.value.type) == (
        "context_length_exceeded",
        "invalid_request_error",
    )
    assert refused.value.param == "messages"
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=SHORT_CHAT, max_tokens=60)  # type: ignore[arg-type]
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=LONG_CHAT)  # type: ignore[arg-type]
    assert (missing.value.code, missing.value.type) == ("model_not_found", "invalid_request_error")


KEYS = {
    "other": Key.create("elsewhere", models=["other"]),
    "rate": Key.create("ratey"),
    "quota": Key.create("quotay"),
    "prompt": Key.create("prompty"),
    "completion": Key.create("completiony"),
    "admin": Key.create("ops", role="admin"),
}
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def keyed(
    tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]
) -> Iterator[ServerProcess]:
    """API keys: one limited to another model, three allowed a request each (the buckets refill
    in 1,000 s), one allowed a request a day."""
    root = tmp_path_factory.mktemp("openai-keyed")
    copy_tiny(tiny_gpt2_built, root)
    once = {"rate_per_s": 0.001, "burst": 1}
    limits = {"ratey": once, "prompty": once, "completiony": once,
              "quotay": {"quota_per_day": 1}}  # fmt: skip
    settings = {"auth": {"keys": [key.entry() for key in KEYS.values()]},
                "rate_limit": {"tenants": limits}, "max_request_bytes": BODY_LIMIT}  # fmt: skip
    process = ServerProcess(
        "--config", str(write_settings(root / "server.yaml", settings)),
        "--model-repository", str(root / "models"), log_path=root / "server.log", grpc=False,
    ).start(timeout_s=90)  # fmt: skip
    yield process
    process.stop()


@pytest.mark.parametrize(
    ("headers", "tries", "status", "kind", "code"),
    [
        # As OpenAI answers them: they were typed authentication_error, permission_error and
        # rate_limit_error (Anthropic's words), and a wrong key had no code.
        ({}, 1, 401, "invalid_request_error", None),
        ({"Authorization": "Bearer sk-wrong"}, 1, 401, "invalid_request_error",
         "invalid_api_key"),
        (KEYS["other"].bearer(), 1, 403, "invalid_request_error", "model_not_found"),
        (KEYS["rate"].bearer(), 2, 429, "requests", "rate_limit_exceeded"),
        (KEYS["quota"].bearer(), 2, 429, "insufficient_quota", "insufficient_quota"),
    ],
    ids=["missing key", "wrong key", "model not allowed", "rate", "quota"],
)  # fmt: skip
def test_auth_and_limit_errors_are_typed_as_openai_types_them(
    keyed: ServerProcess,
    headers: dict[str, str],
    tries: int,
    status: int,
    kind: str,
    code: str | None,
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = f"{keyed.url}/v1/chat/completions"
    replies = [httpx.post(url, json=body, headers=headers, timeout=10) for _ in range(tries)]
    assert [reply.status_code for reply in replies] == [200] * (tries - 1) + [status]
    error = replies[-1].json()["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, None, code)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}),
        ("/v1/completions", {"model": "tiny", "prompt": "a"}),
        ("/v2/models/tiny/generate", {"text_input": "a"}),
        ("/v2/repository/models/tiny/load", {"parameters": {"config": "{}"}}),
    ],
)
def test_a_body_past_the_limit_is_refused_on_every_route(
    keyed: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    """Only the infer route bounded its body by `max_request_bytes`: a prompt, a generate
    request or a repository load of any size was read whole and parsed (a 4 MiB prompt is
    then tokenized for 2 s)."""
    padded = {**body, "pad": "x" * BODY_LIMIT}
    admin = KEYS["admin"].bearer()
    reply = httpx.post(f"{keyed.url}{path}", json=padded, headers=admin, timeout=10)
    assert reply.status_code == 413, reply.text
    assert str(BODY_LIMIT) in reply.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v2/models/tiny/generate"])
def test_a_stranger_s_body_is_never_read(keyed: ServerProcess, path: str) -> None:
    """The OpenAI routes parsed the body, to find the model, before they authenticated: a
    stranger's malformed body was told what was wrong with it (400) instead of 401."""
    reply = httpx.post(f"{keyed.url}{path}", content=b"{not json", timeout=10)
    assert reply.status_code == 401, reply.text


def test_the_openai_client_sees_a_wrong_key_as_openai_sends_it(keyed: ServerProcess) -> None:
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(AuthenticationError) as refused:
        client.models.list()
    assert (refused.value.code, refused.value.type) == ("invalid_api_key", "invalid_request_error")


@pytest.mark.parametrize(
    ("key", "past"),
    [
        ("prompt", {"messages": LONG_CHAT}),
        ("completion", {"messages": SHORT_CHAT, "max_tokens": 60}),
    ],
)
def test_a_request_refused_for_the_context_uses_no_rate_limit(
    keyed: ServerProcess, key: str, past: dict[str, Any]
) -> None:
    # Refused before admission: a prompt past the context took the key's one request of the
    # bucket (it was refused after admission), so the request after it was a 429.
    url, headers = f"{keyed.url}/v1/chat/completions", KEYS[key].bearer()
    fits = {"model": "tiny", "messages": SHORT_CHAT, "max_tokens": 1}
    statuses = [
        httpx.post(url, json=body, headers=headers, timeout=10).status_code
        for body in ({"model": "tiny", **past}, fits, fits)
    ]
    assert statuses == [400, 200, 429]


def refused(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error object of a request to the tiny model that must be answered 400."""
    reply = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=10)
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "counts"),
    [
        ("/v1/chat/completions", {"messages": SHORT_CHAT, "max_tokens": 60},
         "({prompt} in the messages, 60 in the completion). Please reduce the length of the "
         "messages or completion"),
        ("/v1/chat/completions", {"messages": SHORT_CHAT, "max_completion_tokens": 60},
         "({prompt} in the messages, 60 in the completion)"),
        ("/v1/completions", {"prompt": [9] * 58, "max_tokens": 500},
         "({prompt} in your prompt; 500 for the completion). Please reduce your prompt or "
         "completion length"),
    ],
)  # fmt: skip
def test_max_tokens_past_what_the_context_leaves_is_refused_with_both_counts(
    served: tuple[ServerProcess, Path], path: str, body: dict[str, Any], counts: str
) -> None:
    # It was clamped to what the context leaves (a 200, finish reason length), where OpenAI and
    # vLLM's OpenAI server refuse it with these words, which clients match on.
    server, folder = served
    error = refused(server, path, body)
    prompt = len(chat_ids(folder, body["messages"])) if "messages" in body else 58
    requested = prompt + body.get("max_tokens", body.get("max_completion_tokens", 0))
    assert error["message"].startswith(
        f"This model's maximum context length is 64 tokens. However, you requested {requested} "
        f"tokens {counts.format(prompt=prompt)}"
    )


@pytest.mark.parametrize(
    ("path", "body", "what"),
    [
        ("/v1/completions", {"prompt": "a" * 20_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 20_000}]},
         "messages"),
    ],
)  # fmt: skip
def test_a_prompt_longer_than_the_context_ever_holds_is_refused_untokenized(
    served: tuple[ServerProcess, Path], path: str, body: dict[str, Any], what: str
) -> None:
    # It was tokenized first, on the event loop (about 0.5 s a MiB), to be refused for its
    # tokens; more characters than 64 of the model's tokens ever hold are refused as they are.
    error = refused(served[0], path, body)
    assert error["message"].startswith(
        f"This model's maximum context length is 64 tokens. However, your {what} has 20000 "
        "characters, more than 64 tokens of this model ever hold"
    )
    assert error["code"] == ("context_length_exceeded" if what == "messages" else None)


def chat_leaving(folder: Path, low: int, high: int) -> list[dict[str, str]]:
    """A chat whose prompt has from `low` to `high` tokens."""
    for words in range(1, 64):
        messages = [{"role": "user", "content": "dog " * words}]
        if low <= len(chat_ids(folder, messages)) <= high:
            return messages
    raise AssertionError(f"no chat of {low} to {high} tokens")


@pytest.mark.parametrize("max_tokens", [None, "fits"])
@pytest.mark.parametrize("chat", [False, True])
def test_a_completion_may_use_what_the_context_leaves(
    served: tuple[ServerProcess, Path], chat: bool, max_tokens: str | None
) -> None:
    # Without max_tokens the model's default (16) is clamped to what the prompt leaves, never
    # refused (as vLLM clamps its default); a max_tokens of exactly that fits.
    server, folder = served
    body: dict[str, Any]
    if chat:
        messages = chat_leaving(folder, 50, 60)
        ids, path, body = chat_ids(folder, messages), "/v1/chat/completions", {"messages": messages}
    else:
        ids = [9] * 58
        path, body = "/v1/completions", {"prompt": ids}
    room = 64 - len(ids)
    if max_tokens == "fits":
        body["max_tokens"] = room
    reply = httpx.post(
        f"{server.url}{path}", json={"model": "tiny", "temperature": 0, **body}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    text, count, finish = expected(folder, ids, room)
    choice = answer["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == text
    assert (choice["finish_reason"], answer["usage"]["completion_tokens"]) == (finish, count)


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="tiny",version="1"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_disconnected_stream_leaves_no_cache_reserved(served: tuple[ServerProcess, Path]) -> None:
    # The tiny model may finish before the disconnect is seen (there is no hook to hold the
    # scheduler over HTTP yet); the unit test asserts the slot is freed mid-stream.
    server, _ = served
    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 60, "temperature": 0,
            "stop": "\u0000never", "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as reply,
    ):
        assert next(reply.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 10
    while metric(server, "sluice_generation_kv_cache_used_bytes") > 0:
        assert time.monotonic() < deadline, "the slot was not freed after the disconnect"
        time.sleep(0.05)
    assert metric(server, "sluice_generation_running_sequences") == 0
    assert metric(server, "sluice_generation_tokens_total") > 0
    assert metric(server, "sluice_generation_prompt_tokens_total") > 0


def test_a_repeated_prompt_prefix_is_a_prefix_cache_hit(served: tuple[ServerProcess, Path]) -> None:
    server, folder = served
    shared = list(range(150, 190))  # 40 tokens: two whole 16-token blocks
    url = f"{server.url}/v1/completions"
    httpx.post(url, json={"model": "tiny", "prompt": [*shared, 1], "max_tokens": 2}, timeout=30)
    before = metric(server, "sluice_generation_prefix_hit_tokens_total")
    body = {"model": "tiny", "prompt": [*shared, 2, 3], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(url, json=body, timeout=30).json()
    assert metric(server, "sluice_generation_prefix_hit_tokens_total") - before == 32
    assert reply["choices"][0]["text"] == expected(folder, [*shared, 2, 3], 8)[0]


@pytest.fixture(scope="module")
def long_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A 1,024-token context and no end-of-text stop: a generation runs long enough to leave."""
    root = tmp_path_factory.mktemp("openai-long")
    tiny_gpt2(root / "hf", n_positions=1024)
    version = publish_tiny(root / "hf", root / "models")
    config = version.parent / "config.yaml"
    config.write_text(config.read_text().replace("eos_token_ids:\n  - 0", "eos_token_ids: []"))
    process = ServerProcess(
        "--model-repository", str(root / "models"), log_path=root / "server.log", grpc=False
    ).start(timeout_s=90)
    yield process
    process.stop()


def wait_for(server: ServerProcess, name: str, value: float) -> None:
    deadline = time.monotonic() + 20
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never became {value}"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"logprobs": True}, "logprobs is not supported", "logprobs"),
        # The hand-written scheduler (GPT-2 folders) has no guided decoding.
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
         "tools: tiny: guided decoding (response_format, tools) is not supported by this model",
         "tools"),
        ({"response_format": {"type": "json_object"}},
         "response_format: tiny: guided decoding (response_format, tools) is not supported by "
         "this model", "response_format"),
        ({"messages": [{"role": "banana", "content": "hi"}]},
         "messages[0].role must be one of system, developer, user, assistant, tool; got 'banana'",
         "messages[0].role"),
        ({"messages": [{"role": 2**64, "content": "hi"}]},
         "messages[0].role must be one of system, developer, user, assistant, tool; "
         "got 2^64 or more", "messages[0].role"),
        ({"messages": [{"role": None, "content": "hi"}]},
         "messages[0].role must be one of system, developer, user, assistant, tool; got null",
         "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}, {"content": "hi"}]},
         "messages[1].role is required: one of system, developer, user, assistant, tool",
         "messages[1].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content is required: a string",
         "messages[0].content"),
    ],
)  # fmt: skip
def test_chat_parameters_it_cannot_honour_are_refused_not_ignored(
    served: tuple[ServerProcess, Path], extra: dict[str, Any], message: str, param: str
) -> None:
    server, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body | extra, timeout=10)
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == param


def test_values_that_ask_for_nothing_are_taken(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    unused = {"n": None, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0,
              "logit_bias": {}, "logprobs": None, "echo": False, "tool_choice": "none",
              "stream": None}  # fmt: skip
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": 0}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    given = httpx.post(f"{server.url}/v1/completions", json=body | unused, timeout=10)
    assert plain.status_code == given.status_code == 200, given.text
    assert given.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v2/models/tiny/generate"])
def test_a_client_that_leaves_cancels_its_generation(
    long_served: ServerProcess, stream: bool, path: str
) -> None:
    server = long_served
    if path.startswith("/v2"):
        path += "_stream" if stream else ""
        body = {"text_input": "a", "max_tokens": 1000, "temperature": 0}
    else:
        body = {"model": "tiny", "prompt": [3], "max_tokens": 1000, "temperature": 0,
                "stream": stream}  # fmt: skip
    payload = orjson.dumps(body)
    before = metric(server, "sluice_generation_tokens_total")
    with socket.create_connection(("127.0.0.1", server.http_port)) as client:
        client.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(server, "sluice_generation_running_sequences", 1)
        assert metric(server, "sluice_generation_kv_cache_used_bytes") > 0
    wait_for(server, "sluice_generation_running_sequences", 0)
    assert metric(server, "sluice_generation_kv_cache_used_bytes") == 0
    assert metric(server, "sluice_generation_tokens_total") - before < 999
