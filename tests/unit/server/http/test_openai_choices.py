"""Several choices in one answer (server/http/openai_choices.py), over fake token streams (the
stream of tool calls: test_openai_answer.py)."""

from __future__ import annotations

from server.http.openai_choices import Peeked, merged, seeded
from tests.unit.server.http.token_streams import FakeStream


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
