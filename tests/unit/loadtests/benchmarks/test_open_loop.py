"""The open-loop generator: its HTTP/1.1 response reader on bytes a server could send (the
server is untrusted: sizes are bounded, anything unexpected is a ResponseError), and the rates
and quantiles its summary reports."""

from __future__ import annotations

import asyncio
import math

import pytest

from loadtests.benchmarks.open_loop import (
    MAX_BODY_BYTES,
    Answer,
    ClosedBeforeAnswer,
    Connections,
    OpenLoopResult,
    ResponseError,
    _read_response,
)


async def read(data: bytes) -> tuple[int, bool]:
    reader = asyncio.StreamReader(limit=1024)
    reader.feed_data(data)
    reader.feed_eof()
    return await _read_response(reader)


async def test_a_response_and_its_body_are_read_and_the_connection_kept() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(
        b"HTTP/1.1 504 Gateway Timeout\r\ncontent-length: 5\r\n\r\nabcdeHTTP/1.1 200 OK"
    )
    assert await _read_response(reader) == (504, True)
    assert await reader.readexactly(8) == b"HTTP/1.1"  # the body was consumed, no more


async def test_connection_close_is_honoured() -> None:
    assert await read(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n") == (
        200,
        False,
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "no Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "no Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1),
            f"at most {MAX_BODY_BYTES} are read",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "body cut short"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", "no complete response head"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 400 + b"\r\n", "no complete response head"),
    ],
)
async def test_what_is_not_a_readable_response_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ResponseError, match=message):
        await read(data)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class KeepAliveServer:
    """A server that answers `answers_per_connection` requests on each connection, then closes
    it without answering the next, as a keep-alive timeout closes an idle one. `answered`: the
    requests each connection answered."""

    def __init__(self, answers_per_connection: int) -> None:
        self.answers = answers_per_connection
        self.answered: list[int] = []
        self.handlers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await asyncio.gather(*self.handlers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append(task)
        self.answered.append(0)
        try:
            for _ in range(self.answers):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(OK)
                await writer.drain()
                self.answered[-1] += 1
            await reader.readuntil(b"\r\n\r\n")  # the next request: closed unanswered
        except asyncio.IncompleteReadError:
            pass  # the client closed it first
        finally:
            writer.close()
            await writer.wait_closed()


async def test_a_kept_alive_connection_closed_while_idle_is_replaced_once() -> None:
    server = KeepAliveServer(answers_per_connection=1)
    async with server as url:
        connections = Connections(url)
        assert [await connections.post("/", b"", {}) for _ in range(3)] == [200, 200, 200]
        await connections.close()
    assert server.answered == [1, 1, 1]  # each reused connection was closed, the request resent


async def test_a_new_connection_closed_before_any_answer_is_an_error() -> None:
    server = KeepAliveServer(answers_per_connection=0)
    async with server as url:
        connections = Connections(url)
        with pytest.raises(ClosedBeforeAnswer):
            await connections.post("/", b"", {})
        await connections.close()
    assert server.answered == [0]  # not sent again: only a reused connection is


def test_the_summary_counts_goodput_within_the_target_and_throughput_within_the_span() -> None:
    answers = [
        Answer("200", 0.010, True),
        Answer("200", 0.050, True),
        Answer("200", 0.300, True),  # answered, but past the 0.1 s target
        Answer("200", 0.020, False),  # answered after the span ended: not in ok_rps
        Answer("504", 0.090, True),
        Answer("unanswered", 30.0, False),
    ]
    summary = OpenLoopResult(3.0, 2.0, answers, 0.004).summary(0.1)
    assert summary["sent"] == 6
    assert summary["ok_rps"] == pytest.approx(1.5)  # 3 in-span 200s over 2 s
    assert summary["goodput_rps"] == pytest.approx(1.0)  # 2 of them within 0.1 s
    assert summary["shed_fraction"] == pytest.approx(1 / 6)
    assert summary["ok_p50_ms"] == pytest.approx(50.0)
    assert summary["ok_p99_ms"] == pytest.approx(300.0)
    assert summary["all_p99_ms"] == pytest.approx(300.0)  # the unanswered one is no answer
    assert summary["statuses"] == {"200": 4, "504": 1, "unanswered": 1}
    assert summary["send_lag_p99_ms"] == pytest.approx(4.0)


def test_a_run_with_no_answers_reports_no_latency() -> None:
    summary = OpenLoopResult(1.0, 1.0, [Answer("error", 0.1, True)], 0.0).summary(0.1)
    assert summary["ok_rps"] == 0.0
    assert math.isnan(summary["ok_p99_ms"])
