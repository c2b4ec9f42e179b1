"""A connection's deadlines, all woken for by one timer: its read timeouts, keep-alive's idle
bound and its write timeout (server/http/connection.py's HttpProtocol is built on this).

- Read timeouts. A request head (request line and headers) must arrive whole within
  `http_header_timeout_s` of its first byte (or of the connection opening), and its body within
  `http_body_timeout_s` of the head; otherwise the client gets 408 and the connection closes.
  uvicorn has neither, so a client sending a byte every few seconds held a connection forever.
  While the server itself holds reading (server/http/pipelining.py), the bound runs again.
- Write timeout. A connection whose client reads none of its unsent answers for
  `http_write_timeout_s` is aborted, its requests' work cancelled (the client is gone to them);
  a close waits for the unsent answers only that long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.http.connection_policy import REQUEST_TIMEOUT, ConnectionPolicy

log = logging.getLogger("sluice.http")


class TimedConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines of the module docstring."""

    def __init__(self, *args: Any, policy: ConnectionPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self._read_deadline: float | None = None  # loop time the request's bytes are due by
        self._idle_deadline: float | None = None  # keep-alive's: loop time the next one is due by
        self._timer: asyncio.TimerHandle | None = None  # wakes for the earlier deadline
        self._write_deadline: float | None = None  # loop time unsent answers must move by
        self._write_left = 0  # bytes unsent when it was set
        self._reading_body = False  # a request's head is in, its body is not
        self._unread = b""  # read past the pipelining bound; parsed once below it

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
