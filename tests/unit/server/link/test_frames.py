"""The control channel's framing (server/link/frames.py): frames split anywhere by the socket come
out whole and in order, and anything that is not a frame of the protocol is a ProtocolError."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import server.link.frames
from server.link.frames import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameBuffer,
    Kind,
    ProtocolError,
    frame,
    list_frames,
)

MESSAGES = [
    (Kind.INFER, {"id": 1, "slot": 0, "inputs": [["x", "<f4", [1, 16], 0, 64]]}),
    (Kind.FREE_OUT, {"slots": [64, 128]}),
    (Kind.CANCEL, {"id": 2}),
    (Kind.EVENTS, {"requests": [["m", "1", "http", 200, 0.001]], "encoded": []}),
]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_frames_split_anywhere_come_out_whole_and_in_order(cuts: list[int]) -> None:
    data = b"".join(frame(kind, payload) for kind, payload in MESSAGES) * 3
    buffer, got, at = FrameBuffer(), [], 0
    for cut in cuts:
        got += buffer.feed(data[at : at + cut])
        at += cut
    got += buffer.feed(data[at:])
    assert got == MESSAGES * 3


def test_a_partial_frame_waits_for_the_rest() -> None:
    whole = frame(Kind.CANCEL, {"id": 7})
    buffer = FrameBuffer()
    assert buffer.feed(frame(Kind.CANCEL, {"id": 6}) + whole[:3]) == [(Kind.CANCEL, {"id": 6})]
    assert buffer.feed(whole[3:-1]) == []
    assert buffer.feed(whole[-1:] + whole) == [(Kind.CANCEL, {"id": 7})] * 2


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (HEADER.pack(2, 99) + b"{}", "kind 99, 2 bytes"),  # a kind the protocol does not have
        (HEADER.pack(3, Kind.CANCEL) + b"{x}", "bad frame"),  # not JSON
        (HEADER.pack(2, Kind.CANCEL) + b"\xff\xfe", "bad frame"),  # not UTF-8
        (HEADER.pack(MAX_FRAME_BYTES + 1, Kind.INFER), "passes the"),  # refused before its body
    ],
)
def test_what_is_not_a_frame_is_a_protocol_error(data: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        FrameBuffer().feed(data)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 44), min_size=1, max_size=30))
def test_list_frames_carry_every_item_in_order_within_the_limit(lengths: list[int]) -> None:
    # A flush's requests (or answers) go as few list frames as fit in MAX_FRAME_BYTES, each
    # item as it was encoded; one item may take all of a frame but its brackets.
    limit = 48
    items = [orjson.dumps("x" * n) for n in lengths]  # up to 46 bytes, the most one may take
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server.link.frames, "MAX_FRAME_BYTES", limit)
        frames = list_frames(Kind.RESULT, items)
    assert all(len(f) - HEADER.size <= limit for f in frames)
    parsed = [message for data in frames for message in FrameBuffer().feed(data)]
    assert {kind for kind, _ in parsed} == {Kind.RESULT}
    assert [orjson.dumps(item) for _, payload in parsed for item in payload] == items
    assert len(frames) <= 1 + sum(len(i) + 1 for i in items) // (limit // 2)
