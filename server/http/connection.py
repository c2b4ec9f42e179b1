"""HTTP connections: read timeouts, a connection cap, and a shutdown that loses no request.

uvicorn's httptools protocol with these additions:

- Read timeouts and a write timeout (server/http/timeouts.py): a request head and its body must
  arrive within their bounds (else 408), and a client that reads none of its answers is let go.
- A connection cap: past `http_max_connections` open connections, a new one is answered 503
  (Retry-After) and closed at once.
- Drain. uvicorn's shutdown closes every idle keep-alive connection at once, under requests the
  clients have already written (they get EOF or a reset, no answer). Here a draining connection
  is never closed under a request: one in progress is answered with `Connection: close`; an idle
  one stays open `DRAIN_IDLE_S` for a request already on its way (answered, 503 while the engine
  drains, with `Connection: close`) and is closed only while no request is on it.
- One write per answer: a response's head and body leave in one writev (server/http/cycle.py).
  The RESPOND scope extension sends a whole answer at once, past ASGI's two `send` calls.
- The client leaving: a request learns it from the connection's loss, through the WHEN_GONE
  scope extension, without a task per request reading `receive()` for `http.disconnect`. Reading
  goes on once a request's body is in, so the loss is seen whatever the body's size (uvicorn
  stops reading while over 64 KiB of body wait for the app, until its next `receive()`, which an
  app holding its whole body never makes). uvicorn told only the last request read that its
  client left; the one being answered is told too, and the queued ones are let go.
- Lingering close. An answer sent before the request's body has all arrived (503 at the door
  while draining, an early error) is followed by reading and dropping the rest of the body before
  the connection closes: closing a socket with unread data makes the kernel reset the
  connection, and the reset can destroy the answer before the client reads it. A request that
  asked for `Expect: 100-continue` and was answered before any 100 Continue has no body coming:
  its connection closes after the answer.
- Bounded memory per connection (server/http/pipelining.py): pipelined requests and unsent
  answers are bounded; past either, the connection is not read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from server.http.connection_policy import TOO_MANY_CONNECTIONS, ConnectionPolicy
from server.http.cycle import RESPOND, WHEN_GONE, CycleTransport
from server.http.pipelining import BoundedConnection, HeldFlow

log = logging.getLogger("sluice.http")

DRAIN_IDLE_S = 1.0
"""How long a draining keep-alive connection with no request on it stays open: a client that is
writing its next request gets it answered, one that is not writing is closed like any idle one."""


class HttpProtocol(BoundedConnection):
    """One HTTP/1.1 connection (see the module docstring): its deadlines are TimedConnection's
    (server/http/timeouts.py), its bounds BoundedConnection's (server/http/pipelining.py)."""

    def __init__(self, *args: Any, policy: ConnectionPolicy, **kwargs: Any) -> None:
        super().__init__(*args, policy=policy, **kwargs)
        self._drain_timer: asyncio.TimerHandle | None = None
        self._in_message = False  # a request's bytes have begun and its last byte is not in
        self._body_seen = False  # a byte of its body has arrived
        self._close_after_body = False  # answered; close once the body has been read
        self._running: RequestResponseCycle | None = None  # the request being answered

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = HeldFlow(transport, self)
        transport.set_write_buffer_limits(high=self.policy.write_buffer_bytes)
        if len(self.connections) > self.policy.max_connections:
            log.warning("connection refused: %d open connections", len(self.connections) - 1)
            self._close_with(TOO_MANY_CONNECTIONS)
            return
        self._arm_read(self.policy.header_timeout_s)  # the first request head
        if self.policy.draining:
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        # uvicorn tells only the last request read; one answered meanwhile (pipelining) too.
        for cycle in (self._running, self.cycle):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
                if isinstance(cycle.transport, CycleTransport):
                    cycle.transport.gone()
        # Queued requests never started: nobody is left to answer. The requests and their
        # transports point back here: let go, or the connection waits for a full collection.
        self.pipeline.clear()
        self._unread = b""
        self.cycle = self._running = None  # type: ignore[assignment]

    # -- a request's events -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        if self._read_deadline is None:  # keep the clock of a head that began on connection_made
            self._arm_read(self.policy.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._reading_body = True
        self._body_seen = False
        self._body_bytes = 0
        self._arm_read(self.policy.body_timeout_s)
        if self.pipeline:  # uvicorn stopped reading at a pipelined request; the bounds decide
            self.flow.resume_reading()
        if self.cycle is not None and self.cycle.scope is self.scope:  # this request's cycle
            transport = CycleTransport(self, self.cycle)
            self.cycle.transport = transport  # type: ignore[assignment]
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[WHEN_GONE] = transport.when_gone
            extensions[RESPOND] = transport.respond
            if self.policy.draining:
                self.cycle.keep_alive = False  # the answer says Connection: close

    def on_body(self, body: bytes) -> None:
        self._body_seen = True
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_message = self._reading_body = False
        self._cancel_read()
        if self._close_after_body:
            self._close()
        else:  # the body is in: read on, to see the client leave (above), within the bounds
            self.flow.resume_reading()

    def close_after_body(self) -> None:
        """Close now, or, while the request's body is still arriving, once it is read (bounded
        by the body timeout): see the module docstring."""
        if self._reading_body and not self.transport.is_closing():
            self._close_after_body = True
            self.flow.resume_reading()
        else:
            self._close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    # -- drain -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Called by uvicorn (and for connections opened while draining): finish the request in
        progress with `Connection: close`, or close once no request is on its way."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A response already started keeps its keep-alive promise: the client may write its
            # next request, which on_response_complete then waits for (DRAIN_IDLE_S).
            if not cycle.response_started:
                cycle.keep_alive = False
        else:
            self._arm_drain()

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()
        else:  # uvicorn's steps, its keep-alive timer a deadline the connection's timer wakes for
            self.server_state.total_requests += 1
            self.flow.resume_reading()
            deadline = self._idle_deadline = self.loop.time() + self.timeout_keep_alive
            self._wake_by(deadline)
        if self._reading_body and self.expect_100_continue and not self._body_seen:
            # Answered before "100 Continue" was sent: the client sends no body, and would write
            # its next request where this one's body was awaited. Closed now (RFC 9110 10.1.1).
            self._close_with(b"")
        elif self._close_after_body:
            self._unset_keepalive_if_required()
        elif self.policy.draining and not self.transport.is_closing():
            self._unset_keepalive_if_required()  # the drain's idle bound replaces keep-alive's
            self._arm_drain()
        self._release()  # uvicorn resumed reading before taking the next queued request

    def _arm_drain(self) -> None:
        if self._drain_timer is None and not self.transport.is_closing():
            self._drain_timer = self.loop.call_later(DRAIN_IDLE_S, self._drain_idle)

    def _drain_idle(self) -> None:
        self._drain_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self._in_message and not self.pipeline and not self._unread:
            self._close_with(b"")
        # Otherwise the request on it is answered with Connection: close, which closes it (and a
        # head that never completes is closed by the header timeout).

    def _unset_keepalive_if_required(self) -> None:
        super()._unset_keepalive_if_required()
        self._idle_deadline = None  # the timer, if set, wakes to find it gone

    def _cancel_timers(self) -> None:
        self._cancel_deadlines()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None


def accept_pending(listener: socket.socket) -> list[socket.socket]:
    """Accept every connection the kernel has queued on `listener` (non-blocking). Closing a
    listening socket resets the connections still queued on it, and a client may already have
    written its request on one: they are accepted and answered instead."""
    listener.setblocking(False)
    accepted: list[socket.socket] = []
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return accepted
        except OSError as exc:  # e.g. EMFILE: the rest cannot be taken
            log.warning("could not accept queued connections at shutdown: %s", exc)
            return accepted
        sock.setblocking(False)
        accepted.append(sock)
