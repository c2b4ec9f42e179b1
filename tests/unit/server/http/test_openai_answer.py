"""server.http.openai_answer: an OpenAI answer's objects (completion and chat completion, their
chunks and usage) and its server-sent events, tool calls held back and sent whole, over fake
token streams."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from engine.generation.sequence import Chunk
from server.http.openai_answer import Completion, refused_grammar, stream_events
from server.http.openai_choices import Peeked
from server.http.openai_tools import tool_plan
from tests.unit.server.http.token_streams import FakeStream

CLOCK = {"type": "function", "function": {"name": "clock"}}


async def events(streams: list[FakeStream], body: dict[str, Any]) -> list[Any]:
    plan = tool_plan(body)
    answer = Completion(True, "m", 2)
    raw = [e async for e in stream_events([Peeked(s) for s in streams], answer, False, plan)]
    assert raw[-1] == b"data: [DONE]\n\n"
    return [orjson.loads(e.removeprefix(b"data: ")) for e in raw[:-1]]


async def test_under_auto_a_call_is_held_back_and_sent_whole_and_text_streams() -> None:
    call = ["", '{"name":', '"clock",', '"arguments":{}}']
    text = ["", "it is ", "noon"]
    got = await events([FakeStream(call), FakeStream(text)], {"tools": [CLOCK], "n": 2})
    deltas: dict[int, list[Any]] = {0: [], 1: []}
    for event in got:
        choice = event["choices"][0]
        deltas[choice["index"]].append((choice["delta"], choice["finish_reason"]))
    # The call: a first chunk with the role, then the whole call with finish tool_calls.
    assert deltas[0][0] == ({"role": "assistant", "content": ""}, None)
    (last, finish) = deltas[0][-1]
    assert finish == "tool_calls"
    assert [c["function"] for c in last["tool_calls"]] == [{"name": "clock", "arguments": "{}"}]
    assert last["tool_calls"][0]["index"] == 0
    assert not any(d.get("content") for d, _ in deltas[0])
    # The text: streamed as it came.
    assert "".join(d.get("content", "") for d, _ in deltas[1]) == "it is noon"
    assert deltas[1][-1][1] == "stop"


async def test_a_call_cut_short_is_sent_as_text() -> None:
    got = await events([FakeStream(['{"name":', '"cl'], "length")], {"tools": [CLOCK]})
    last = got[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in got) == '{"name":"cl'


class SilentStream(FakeStream):
    """A stream whose first chunk never comes (a sequence waiting for its turn)."""

    async def chunks(self) -> Any:
        await asyncio.Event().wait()
        yield Chunk([], "")


async def test_a_request_cancelled_while_its_grammar_waits_cancels_its_streams() -> None:
    streams = [SilentStream(["a"]), SilentStream(["b"])]
    waiting = asyncio.create_task(refused_grammar([Peeked(s) for s in streams]))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert [s.cancelled for s in streams] == [True, True]


async def test_a_refused_grammar_cancels_every_choice() -> None:
    refused = Chunk([], "", "error", InvalidInput("the guided decoding cannot compile it"))
    bad = FakeStream(["x"])
    bad._chunks = [refused]
    streams = [FakeStream(["a", "b"]), bad]
    with pytest.raises(InvalidInput):
        await refused_grammar([Peeked(s) for s in streams])
    assert [s.cancelled for s in streams] == [True, True]


def test_a_whole_completion_and_chat_completion() -> None:
    text = Completion(False, "m", 3)
    assert text.id.startswith("cmpl-")
    assert len(text.id) == len("cmpl-") + 32
    whole = text.whole([text.choice(0, "hi", "stop")], 2)
    assert whole == {
        "id": text.id, "object": "text_completion", "created": text.created, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "text": "hi", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }  # fmt: skip
    chat = Completion(True, "m", 3)
    assert chat.id.startswith("chatcmpl-")
    assert chat.whole([], 0)["object"] == "chat.completion"
    assert chat.choice(1, "hi", "length") == {
        "index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "hi"},
    }  # fmt: skip
    calls = [{"id": "c", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]
    assert chat.choice(0, "ignored", "stop", calls) == {
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "tool_calls": calls},
    }  # fmt: skip


def test_chunks_of_a_chat_and_of_a_completion() -> None:
    chat = Completion(True, "m", 1)
    first = chat.chunk(0, "", None, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": ""}}
    ]
    assert chat.chunk(0, "", "stop")["choices"][0]["delta"] == {}  # no empty content later
    assert chat.chunk(0, None, None, first=True)["choices"][0]["delta"] == {"role": "assistant"}
    calls = [{"id": "c", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]
    last = chat.chunk(0, None, "stop", calls=calls)["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"] == [{"index": 0, **calls[0]}]
    text = Completion(False, "m", 1)
    assert text.chunk(2, None, "stop")["choices"] == [
        {"index": 2, "finish_reason": "stop", "text": "", "logprobs": None}
    ]
    usage = text.usage_chunk(4)
    assert (usage["object"], usage["choices"]) == ("text_completion", [])
    assert usage["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}


async def test_with_include_usage_every_chunk_says_null_and_the_last_counts_every_choice() -> None:
    answer = Completion(False, "m", 2)
    streams = [Peeked(FakeStream(["a", "b"])), Peeked(FakeStream(["c"]))]
    raw = [e async for e in stream_events(streams, answer, True, None)]
    assert raw[-1] == b"data: [DONE]\n\n"
    got = [orjson.loads(e.removeprefix(b"data: ")) for e in raw[:-1]]
    assert all(event["usage"] is None for event in got[:-1])
    assert got[-1]["choices"] == []
    assert got[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    texts = sorted(e["choices"][0]["text"] for e in got[:-1])
    assert texts == ["a", "b", "c"]
    without = [e async for e in stream_events([Peeked(FakeStream(["a"]))], answer, False, None)]
    assert b"usage" not in b"".join(without)


async def test_an_error_chunk_ends_the_stream_with_an_error_event() -> None:
    failing = FakeStream(["a", "x"])
    failing._chunks[1] = Chunk([], "", "error", InvalidInput("out of memory for the sequence"))
    stream = Peeked(failing)
    raw = [e async for e in stream_events([stream], Completion(False, "m", 1), True, None)]
    assert raw[-1] == b"data: [DONE]\n\n"
    error = orjson.loads(raw[-2].removeprefix(b"data: "))
    assert error["error"]["message"] == "out of memory for the sequence"
    assert error["error"]["type"] == "server_error"
    assert not any(b'"usage":{' in e for e in raw)  # no usage after an error
    assert failing.cancelled
