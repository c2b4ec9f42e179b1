"""Several choices in one answer (server/http/openai_choices.py) and the stream of tool calls
(server/http/openai_answer.py), over fake token streams."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from engine.errors import InvalidInput
from engine.generation.sequence import Chunk
from server.http.openai_answer import Completion, refused_grammar, stream_events
from server.http.openai_choices import Peeked, merged, seeded
from server.http.openai_tools import tool_plan

CLOCK = {"type": "function", "function": {"name": "clock"}}


class FakeStream:
    """A TokenStream yielding `texts` (one token each), the last with `finish`."""

    def __init__(self, texts: list[str], finish: str = "stop") -> None:
        self._chunks = [Chunk([i], t) for i, t in enumerate(texts)]
        self._chunks[-1].finish_reason = finish  # type: ignore[assignment]
        self.cancelled = False
        self.headers: dict[str, str] = {}
        self.prompt_tokens = 2
        self.completion_tokens = len(texts)
        self.finish_reason = finish

    async def chunks(self) -> Any:
        for chunk in self._chunks:
            await asyncio.sleep(0)  # the others' turn: their chunks interleave
            yield chunk

    def cancel(self) -> None:
        self.cancelled = True


async def test_merged_tags_every_chunk_with_its_choice_until_all_finish() -> None:
    streams = [Peeked(FakeStream(["a", "b", "c"])), Peeked(FakeStream(["x", "y"]))]
    got = [(index, chunk.text) async for index, chunk in merged(streams)]
    assert [t for i, t in got if i == 0] == ["a", "b", "c"]
    assert [t for i, t in got if i == 1] == ["x", "y"]
    assert [i for i, _ in got] != [0, 0, 0, 1, 1]  # interleaved, not one after the other


async def test_a_peeked_chunk_is_yielded_once() -> None:
    stream = Peeked(FakeStream(["a", "b"]))
    assert (await stream.peek()).text == "a"
    assert (await stream.peek()).text == "a"
    assert [c.text async for c in stream.chunks()] == ["a", "b"]


def test_each_choice_after_the_first_takes_the_next_seed() -> None:
    assert seeded({"seed": 7}, 0) == {"seed": 7}
    assert seeded({"seed": 7}, 2) == {"seed": 9}
    assert seeded({"seed": 2**63 - 1}, 1) == {"seed": 0}
    assert seeded({}, 3) == {}


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
