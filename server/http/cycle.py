"""The transport as one request's cycle sees it (HttpProtocol gives each request its own): one
write per answer, a whole answer at once (the RESPOND scope extension), the client leaving (the
WHEN_GONE scope extension), and a close that waits for the request's body."""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

WHEN_GONE = "sluice.when_gone"
"""The scope extension of each request: a function taking the callback to call (or None, to stop
calling it) if the client disconnects before its answer is complete. A task that waits on
`receive()` for `http.disconnect` does the same for each request at several times the cost."""
RESPOND = "sluice.respond"
"""The scope extension of each request: a function `(status, headers, body) -> bool` that sends a
whole answer (its head and body, with `content-length` among `headers`) in one write, True once
sent; False when it cannot (an answer has begun, the client is gone or not reading what it was
sent), and the caller then sends through ASGI. Header names must be lower-case tokens; a value
with a control character is a RuntimeError, as ASGI's send makes it. ASGI's pair of `send` calls
checked each header with two regular expressions and held the head for the body: 2.5 µs of
the benchmark MLP's ~80 in process."""
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")  # uvicorn's: no control characters


class Connection(Protocol):
    """What a request's transport uses of its connection (server.http.connection.HttpProtocol,
    which installs it: the connection knows the cycle, the cycle only this)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def close_after_body(self) -> None:
        """Close now, or once the request's body has been read."""


class CycleTransport:
    """The transport as a request's cycle sees it.

    - One write per answer: uvicorn writes a response's head and its body separately, two send
      syscalls; the head is held until the body's first write and both leave in one writev. A
      head whose body does not follow at once (a stream) is written on the loop's next turn.
    - Lingering close: close() waits for the request's body (server/http/connection.py).
    - The client leaving: `when_gone` (the WHEN_GONE scope extension) sets what is called.
    - A whole answer at once: `respond` (the RESPOND scope extension)."""

    __slots__ = ("_cycle", "_gone", "_head", "_holding", "_left", "_protocol", "_transport")

    def __init__(self, protocol: Connection, cycle: RequestResponseCycle) -> None:
        self._protocol = protocol
        # Weak: the cycle holds this transport, and a cycle of the two per request would wait
        # for the cyclic collector, which the server runs seldom (server.tune_gc).
        self._cycle = weakref.ref(cycle)
        self._transport = protocol.transport
        self._head: bytes | None = None
        self._holding = True  # only the cycle's first write (its head) is held
        self._gone: Callable[[], None] | None = None
        self._left = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.writelines((head, data))
        elif self._holding:
            self._holding = False
            self._head = data
            self._protocol.loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a held head now."""
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._protocol.close_after_body()

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Send a whole answer (see RESPOND); the cycle's state moves as ASGI's sends move it."""
        cycle = self._cycle()
        if cycle is None or cycle.response_started or cycle.disconnected or cycle.flow.write_paused:
            return False
        if _BAD_VALUE.search(b"\t".join([value for _, value in headers])):
            raise RuntimeError("Invalid HTTP header value.")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        head = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self._holding = False
        self._transport.writelines((b"".join(head), body))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.close()
        cycle.on_response()
        return True

    def when_gone(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` if the client disconnects before the answer is complete, at once if
        it has (None: call nothing)."""
        self._gone = callback
        if self._left:
            self.gone()

    def gone(self) -> None:
        """The client disconnected before the answer was complete."""
        self._left = True
        callback, self._gone = self._gone, None
        if callback is not None:
            callback()
