"""Bounded memory per connection: what one client can make the server read and hold.

A client may pipeline requests (send more before reading the answers): at most
`http_max_pipelined_requests` wait behind the one being answered, and while that many wait, or
while over `http_write_buffer_bytes` of answers are unsent (the transport's high-water mark), the
connection is not read; uvicorn resumed reading at each `receive()` and answer, so a client that
pipelined without reading made the server parse and hold every request it sent. A read is parsed
FEED_BYTES at a time (a body of known length whole) so that one read full of small requests
cannot overshoot the bound; what is left of it is parsed once below. (The write timeout that
ends a client reading none of its answers is server/http/timeouts.py's.)
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl

from server.http.timeouts import TimedConnection

FEED_BYTES = 4096
"""The parser is given a read this much at a time (a body of known length whole), checking
the pipelining bound between: a read of up to 256 KiB of minimal requests (18 bytes each) would
otherwise all be parsed and queued at once; this way at most ~230 pass the bound."""


class BoundedConnection(TimedConnection):
    """A connection that stops reading while over the bounds of the module docstring."""

    flow: HeldFlow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._body_bytes = 0  # of the request whose body is being read
        self._feeding = False  # _feed_unread is scheduled
        self._upgraded = False  # handed to a WebSocket protocol

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

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True
        super().handle_websocket_upgrade()


class HeldFlow(FlowControl):
    """uvicorn's flow control, whose resume_reading (called at each `receive()` and answer)
    asks the connection first: reading stays held while the connection is over its bounds."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedConnection) -> None:
        super().__init__(transport)
        self.held = False  # reading is paused for the bounds; resumed once below them
        self._protocol = weakref.ref(protocol)  # the protocol holds this: no cycle of the two

    def resume_reading(self) -> None:
        protocol = self._protocol()
        if self.read_paused and (protocol is None or protocol.may_read()):
            super().resume_reading()
