"""server.http.cycle: the transport as one request's cycle sees it, over a recording transport
(one write per answer, a whole answer at once, the client leaving)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from server.http.cycle import CycleTransport


class Transport:
    """Records what is written, as one list entry per system call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def writelines(self, chunks: Any) -> None:
        self.calls.append(("writelines", b"".join(chunks)))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


class Loop:
    def __init__(self) -> None:
        self.soon: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.soon.append(callback)


class Protocol:
    def __init__(self) -> None:
        self.transport = Transport()
        self.loop = Loop()
        self.closed_after_body = 0

    def close_after_body(self) -> None:
        self.closed_after_body += 1


class Flow:
    write_paused = False


class Cycle:
    """The parts of uvicorn's RequestResponseCycle that respond() reads and moves."""

    def __init__(self, keep_alive: bool = True) -> None:
        self.response_started = False
        self.disconnected = False
        self.waiting_for_100_continue = True
        self.response_complete = False
        self.keep_alive = keep_alive
        self.flow = Flow()
        self.default_headers = [(b"server", b"sluice")]
        self.message_event = asyncio.Event()
        self.responses = 0

    def on_response(self) -> None:
        self.responses += 1


def _transport(cycle: Cycle) -> tuple[CycleTransport, Protocol]:
    protocol = Protocol()
    return CycleTransport(protocol, cycle), protocol  # type: ignore[arg-type]


def test_the_head_waits_for_the_body_and_both_leave_in_one_call() -> None:
    cycle = Cycle()
    transport, protocol = _transport(cycle)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert protocol.transport.calls == []
    transport.write(b"body")
    transport.write(b"more")
    assert protocol.transport.calls == [
        ("writelines", b"HTTP/1.1 200 OK\r\n\r\nbody"),
        ("write", b"more"),
    ]
    protocol.loop.soon[0]()  # the flush the head scheduled: nothing left to write
    assert len(protocol.transport.calls) == 2


def test_a_head_whose_body_does_not_follow_is_written_on_the_next_turn() -> None:
    cycle = Cycle()
    transport, protocol = _transport(cycle)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    (flush,) = protocol.loop.soon
    flush()
    assert protocol.transport.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\n")]
    transport.write(b"chunk")  # a stream's chunks go out as they come
    assert protocol.transport.calls[-1] == ("write", b"chunk")


def test_a_held_head_is_dropped_when_the_connection_is_closing() -> None:
    transport, protocol = _transport(Cycle())
    transport.write(b"head")
    protocol.transport.closing = True
    transport.flush()
    assert protocol.transport.calls == []


def test_close_writes_the_held_head_and_waits_for_the_body() -> None:
    transport, protocol = _transport(Cycle())
    transport.write(b"head")
    transport.close()
    assert protocol.transport.calls == [("write", b"head")]
    assert protocol.closed_after_body == 1


def test_everything_else_is_the_real_transports() -> None:
    transport, _ = _transport(Cycle())
    assert transport.get_extra_info("peername") == "extra peername"


async def test_a_whole_answer_goes_in_one_call_and_moves_the_cycle() -> None:
    cycle = Cycle()
    transport, protocol = _transport(cycle)
    headers = [(b"content-length", b"2"), (b"content-type", b"application/json")]
    assert transport.respond(200, headers, b"{}")
    assert protocol.transport.calls == [
        (
            "writelines",
            b"HTTP/1.1 200 OK\r\nserver: sluice\r\ncontent-length: 2\r\n"
            b"content-type: application/json\r\n\r\n{}",
        )
    ]
    assert cycle.response_started
    assert cycle.response_complete
    assert not cycle.waiting_for_100_continue
    assert cycle.message_event.is_set()
    assert cycle.responses == 1
    assert protocol.closed_after_body == 0


async def test_an_answer_on_a_closing_connection_says_so_and_closes() -> None:
    cycle = Cycle(keep_alive=False)
    transport, protocol = _transport(cycle)
    assert transport.respond(503, [(b"content-length", b"0")], b"")
    ((_, written),) = protocol.transport.calls
    assert written.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert written.endswith(b"content-length: 0\r\nconnection: close\r\n\r\n")
    assert protocol.closed_after_body == 1


@pytest.mark.parametrize("state", ["response_started", "disconnected", "write_paused"])
async def test_no_whole_answer_once_one_began_the_client_left_or_is_not_reading(
    state: str,
) -> None:
    cycle = Cycle()
    target = cycle.flow if state == "write_paused" else cycle
    setattr(target, state, True)
    transport, protocol = _transport(cycle)
    assert not transport.respond(200, [(b"content-length", b"0")], b"")
    assert protocol.transport.calls == []


async def test_no_whole_answer_once_the_cycle_is_gone() -> None:
    cycle = Cycle()
    transport, protocol = _transport(cycle)
    del cycle  # the connection moved on to its next request
    assert not transport.respond(200, [(b"content-length", b"0")], b"")
    assert protocol.transport.calls == []


async def test_a_header_value_with_a_control_character_is_refused() -> None:
    cycle = Cycle()  # the transport holds its cycle weakly: keep it
    transport, protocol = _transport(cycle)
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):
        transport.respond(200, [(b"x-id", b"a\r\nset-cookie: x")], b"")
    assert protocol.transport.calls == []
    assert not cycle.response_started


def test_the_client_leaving_calls_the_callback_once() -> None:
    transport, _ = _transport(Cycle())
    calls: list[str] = []
    transport.when_gone(lambda: calls.append("gone"))
    transport.gone()
    transport.gone()
    assert calls == ["gone"]


def test_a_callback_set_after_the_client_left_is_called_at_once() -> None:
    transport, _ = _transport(Cycle())
    transport.gone()
    calls: list[str] = []
    transport.when_gone(lambda: calls.append("late"))
    assert calls == ["late"]


def test_a_callback_taken_back_is_not_called() -> None:
    transport, _ = _transport(Cycle())
    calls: list[str] = []
    transport.when_gone(lambda: calls.append("gone"))
    transport.when_gone(None)
    transport.gone()
    assert calls == []
