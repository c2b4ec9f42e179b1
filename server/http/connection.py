"""HTTP connections: read timeouts, a connection cap, and a shutdown that loses no request.

uvicorn's httptools protocol with these additions:

- Read timeouts. A request head (request line and headers) must arrive whole within
  `http_header_timeout_s` of its first byte (or of the connection opening), and its body within
  `http_body_timeout_s` of the head; otherwise the client gets 408 and the connection closes.
  uvicorn has neither, so a client sending a byte every few seconds held a connection forever.
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
  app holding its whole body never makes).
- Lingering close. An answer sent before the request's body has all arrived (503 at the door
  while draining, an early error) is followed by reading and dropping the rest of the body before
  the connection closes: closing a socket with unread data makes the kernel reset the
  connection, and the reset can destroy the answer before the client reads it. A request that
  asked for `Expect: 100-continue` and was answered before any 100 Continue has no body coming:
  its connection closes after the answer.
- Bounded memory per connection. A client may pipeline requests (send more before reading the
  answers): at most `http_max_pipelined_requests` wait behind the one being answered, and
  while that many wait, or while over `http_write_buffer_bytes` of answers are unsent (the
  transport's high-water mark), the connection is not read; uvicorn resumed reading at each
  `receive()` and answer, so a client that pipelined without reading made the server parse and
  hold every request it sent. A read is parsed FEED_BYTES at a time (a body of known length
  whole) so that one read full of small requests cannot overshoot the bound; what is left of it
  is parsed once below. A connection whose client reads none of its unsent answers for
  `http_write_timeout_s` is aborted, its requests' work cancelled (the client is gone to them).
  uvicorn told only the last request read that its client left; the one being answered is
  told too, and the queued ones are let go.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server.http.cycle import RESPOND, WHEN_GONE, CycleTransport

if TYPE_CHECKING:
    from server.settings import Settings

log = logging.getLogger("sluice.http")

FEED_BYTES = 4096
"""The parser is given a read this much at a time (a body of known length whole), checking
the pipelining bound between: a read of up to 256 KiB of minimal requests (18 bytes each) would
otherwise all be parsed and queued at once; this way at most ~230 pass the bound."""
DRAIN_IDLE_S = 1.0
"""How long a draining keep-alive connection with no request on it stays open: a client that is
writing its next request gets it answered, one that is not writing is closed like any idle one."""


def _canned(status: bytes, extra: bytes = b"") -> bytes:
    body = b'{"error":"' + status.split(b" ", 1)[1].lower() + b'"}'
    return b"".join(
        [
            b"HTTP/1.1 ",
            status,
            b"\r\ncontent-type: application/json\r\nconnection: close\r\n",
            extra,
            b"content-length: ",
            str(len(body)).encode(),
            b"\r\n\r\n",
            body,
        ]
    )


REQUEST_TIMEOUT = _canned(b"408 Request Timeout")
TOO_MANY_CONNECTIONS = _canned(b"503 Too many connections", b"retry-after: 1\r\n")


@dataclass(slots=True)
class ConnectionPolicy:
    """What every connection of one HTTP server obeys; `draining` is flipped at shutdown."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_pipelined: int = 16
    write_buffer_bytes: int = 64 * 1024
    write_timeout_s: float = 30.0
    draining: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionPolicy:
        """The policy the `http_*` settings describe."""
        return cls(
            settings.http_header_timeout_s,
            settings.http_body_timeout_s,
            settings.http_max_connections,
            settings.http_max_pipelined_requests,
            settings.http_write_buffer_bytes,
            settings.http_write_timeout_s,
        )


class HttpProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection (see the module docstring)."""

    flow: _Flow

    def __init__(self, *args: Any, policy: ConnectionPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self._read_deadline: float | None = None  # loop time the request's bytes are due by
        self._idle_deadline: float | None = None  # keep-alive's: loop time the next one is due by
        self._timer: asyncio.TimerHandle | None = None  # wakes for the earlier deadline
        self._drain_timer: asyncio.TimerHandle | None = None
        self._in_message = False  # a request's bytes have begun and its last byte is not in
        self._reading_body = False  # its head is in, its body is not
        self._body_seen = False  # a byte of its body has arrived
        self._close_after_body = False  # answered; close once the body has been read
        self._body_bytes = 0  # of the request whose body is being read
        self._write_deadline: float | None = None  # loop time unsent answers must move by
        self._write_left = 0  # bytes unsent when it was set
        self._unread = b""  # read past the pipelining bound; parsed once below it
        self._feeding = False  # _feed_unread is scheduled
        self._upgraded = False  # handed to a WebSocket protocol
        self._running: RequestResponseCycle | None = None  # the request being answered

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self)
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

    # -- read timeouts ---------------------------------------------------------------------------

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

    # The read bound and keep-alive's are deadlines, and one timer per connection wakes for
    # them: each request moves the read deadline (twice: its head, then its body) and clears it,
    # and sets keep-alive's, which its next request's first bytes clear; a timer is set only
    # when a deadline comes before the one already set. A timer that wakes to find the
    # deadlines moved on sets itself for the earlier one; one that finds none stops. A timer set
    # and cancelled for each bound, three a request, had cost 3.5 µs of the benchmark MLP's ~80
    # in process.

    def _arm_read(self, timeout_s: float) -> None:
        deadline = self._read_deadline = self.loop.time() + timeout_s
        self._wake_by(deadline)

    def _cancel_read(self) -> None:
        self._read_deadline = None  # the timer, if set, wakes to find nothing due

    def _wake_by(self, deadline: float) -> None:
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline, self._deadline_due)

    def _deadline_due(self) -> None:
        self._timer = None
        now = self.loop.time()
        write = self._write_deadline
        if write is not None and now >= write and self._write_timed_out():
            return
        read, idle = self._read_deadline, self._idle_deadline
        if read is not None and now >= read:
            if not self.flow.read_paused:
                self._read_timed_out()
                return
            # The server is not reading (the bounds, or an app not taking its body yet): no
            # fault of the client's. The bound runs again from now.
            policy = self.policy
            timeout_s = policy.body_timeout_s if self._reading_body else policy.header_timeout_s
            self._read_deadline = now + timeout_s
        elif idle is not None and now >= idle:
            self._idle_deadline = None
            if not self._unread:  # else a request is in, held by the bounds: not idle
                self.timeout_keep_alive_handler()
                return
        deadlines = (self._read_deadline, self._idle_deadline, self._write_deadline)
        due = [d for d in deadlines if d is not None]
        if due:  # moved on since this timer was set
            self._wake_by(min(due))

    def _cancel_deadlines(self) -> None:
        self._read_deadline = self._idle_deadline = self._write_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        cycle = self.cycle
        answer = REQUEST_TIMEOUT
        if self._reading_body and cycle is not None:
            if cycle.response_started:  # answered early (or lingering): no second answer
                answer = b""
            if not cycle.response_complete:  # the app may wait on the body
                cycle.disconnected = True  # its receive() says http.disconnect; sends dropped
                cycle.message_event.set()
        log.info("closing connection from %s: request not received in time", self.client)
        self._close_with(answer)

    def _close_with(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            if answer:
                self.transport.write(answer)
            self._close()

    def _close(self) -> None:
        """Close once the unsent answers are out, or after the write timeout if they do not
        move: a transport closes only once its buffer is written, which a client that does not
        read would otherwise put off forever."""
        self.transport.close()
        self._watch_unsent()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._close()

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(msg)
        self._watch_unsent()

    # -- bounded memory --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._unread:  # not expected while reading is held; kept in order if it happens
            self._unread += data
        elif len(data) <= FEED_BYTES:
            super().data_received(data)
        else:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` FEED_BYTES at a time (see FEED_BYTES); past the bound, hold reading and
        keep the rest for later."""
        view, start, end = memoryview(data), 0, len(data)
        while start < end:
            if self._over_bounds():
                self._unread = bytes(view[start:])
                self._hold()
                return
            step = FEED_BYTES
            if self._reading_body:  # a body of known length cannot hold further requests
                step = max(step, self._body_left())
            super().data_received(view[start : start + step])  # type: ignore[arg-type]
            start += step
            if self.parser is None or self._upgraded or self.transport.is_closing():
                return

    def _body_left(self) -> int:
        """Bytes of the current request's body still to come (0 when its length is unknown)."""
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) - self._body_bytes  # llhttp has checked it is a number
        return 0

    def _over_bounds(self) -> bool:
        """Too much held for this connection: answers unsent past the high-water mark, or the
        most pipelined requests queued (or a queued one's body past uvicorn's bound)."""
        pipeline = self.pipeline
        return self.flow.write_paused or (
            bool(pipeline)
            and (
                len(pipeline) >= self.policy.max_pipelined
                or len(self.cycle.body) > HIGH_WATER_LIMIT
            )
        )

    def _hold(self) -> None:
        self.flow.held = True
        self.flow.pause_reading()

    def may_read(self) -> bool:
        """Whether reading may resume now (the flow control's resume_reading asks): not while
        over the bounds (held until below), nor before what was left of a read is parsed."""
        if self._over_bounds():
            self._hold()
            return False
        self.flow.held = False
        if self._unread:
            if not self._feeding:
                self._feeding = True
                self.loop.call_soon(self._feed_unread)
            return False
        return True

    def _feed_unread(self) -> None:
        self._feeding = False
        data, self._unread = self._unread, b""
        if data and self.parser is not None and not self.transport.is_closing():
            self._feed(data)
            self.flow.resume_reading()

    def _release(self) -> None:
        """Something held shrank: resume reading if the bounds held it."""
        if self.flow.held:
            self.flow.resume_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._hold()
        self._watch_unsent()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_deadline = None  # the timer, if set, wakes to find it gone
        self._release()

    def _watch_unsent(self) -> None:
        """Set the write deadline while answers are unsent (and not already set)."""
        if self._write_deadline is None and self.transport.get_write_buffer_size():
            self._arm_write()

    def _arm_write(self) -> None:
        self._write_left = self.transport.get_write_buffer_size()
        deadline = self._write_deadline = self.loop.time() + self.policy.write_timeout_s
        self._wake_by(deadline)

    def _write_timed_out(self) -> bool:
        """At the write deadline: abort the connection if none of its unsent answers went out
        since the deadline was set (True); otherwise set the next one, or none if all went."""
        left = self.transport.get_write_buffer_size()
        if not left:
            self._write_deadline = None
            return False
        if left < self._write_left:  # the client is reading, slowly
            self._arm_write()
            return False
        log.info(
            "closing connection from %s: %d bytes of answers not read in %.1f s",
            self.client,
            left,
            self.policy.write_timeout_s,
        )
        self._cancel_deadlines()
        self.transport.abort()  # close() would wait for the buffer to be written
        return True

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True
        super().handle_websocket_upgrade()

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


class _Flow(FlowControl):
    """uvicorn's flow control, whose resume_reading (called at each `receive()` and answer)
    asks the connection first: reading stays held while the connection is over its bounds."""

    def __init__(self, transport: asyncio.Transport, protocol: HttpProtocol) -> None:
        super().__init__(transport)
        self.held = False  # reading is paused for the bounds; resumed once below them
        self._protocol = weakref.ref(protocol)  # the protocol holds this: no cycle of the two

    def resume_reading(self) -> None:
        protocol = self._protocol()
        if self.read_paused and (protocol is None or protocol.may_read()):
            super().resume_reading()


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
