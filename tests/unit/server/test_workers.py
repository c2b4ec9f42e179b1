"""server.workers: how the engine and worker processes take the supervisor's orders, a byte on a
pipe (S: stop; D: drain, the stop coming later; the pipe's end: the supervisor died, stop).
The processes themselves run in tests/integration/test_workers*.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

import pytest

from server.workers import _orders


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    yield read, write
    for fd in (read, write):
        with contextlib.suppress(OSError):  # closed by the test
            os.close(fd)


class Orders:
    """What `_orders` called, in order; `wait` returns once `stop` was."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stopped = asyncio.Event()
        self.drained = asyncio.Event()

    def stop(self) -> None:
        self.calls.append("stop")
        self.stopped.set()

    def drain(self) -> None:
        self.calls.append("drain")
        self.drained.set()

    async def wait(self) -> list[str]:
        async with asyncio.timeout(5):
            await self.stopped.wait()
        return self.calls


async def test_s_stops(pipe: tuple[int, int]) -> None:
    orders = Orders()
    _orders(pipe[0], orders.stop, orders.drain)
    os.write(pipe[1], b"S")
    assert await orders.wait() == ["stop"]
    # Its reader is gone: a second S (or the pipe's end) is never read, never a second stop.
    assert asyncio.get_running_loop().remove_reader(pipe[0]) is False


async def test_d_drains_and_the_stop_comes_later(pipe: tuple[int, int]) -> None:
    orders = Orders()
    _orders(pipe[0], orders.stop, orders.drain)
    os.write(pipe[1], b"D")
    async with asyncio.timeout(5):
        await orders.drained.wait()
    assert orders.calls == ["drain"]
    assert asyncio.get_running_loop().remove_reader(pipe[0]) is True  # still listening
    _orders(pipe[0], orders.stop, orders.drain)
    os.write(pipe[1], b"S")
    assert await orders.wait() == ["drain", "stop"]


async def test_d_and_s_read_together_drain_then_stop(pipe: tuple[int, int]) -> None:
    orders = Orders()
    os.write(pipe[1], b"DS")
    _orders(pipe[0], orders.stop, orders.drain)
    assert await orders.wait() == ["drain", "stop"]


async def test_a_worker_without_drain_takes_d_as_a_stop(pipe: tuple[int, int]) -> None:
    orders = Orders()
    os.write(pipe[1], b"D")
    _orders(pipe[0], orders.stop)
    assert await orders.wait() == ["stop"]


async def test_the_supervisor_gone_stops_and_says_so(
    pipe: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    orders = Orders()
    _orders(pipe[0], orders.stop, orders.drain)
    with caplog.at_level(logging.WARNING, "sluice.workers"):
        os.close(pipe[1])
        assert await orders.wait() == ["stop"]
    assert "the supervisor is gone: stopping" in caplog.text
