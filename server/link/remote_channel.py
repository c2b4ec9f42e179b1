"""The worker's end of its connection to the engine process (frames.py): `EngineChannel`
holds what every exchange on that one unix socket shares, whatever it asks. Frames go out in
one write per loop iteration, requests after two (those of both iterations in one INFER frame,
INFER_FLUSH_TURNS; the answer slots the worker is done with riding on it); each call has its
own id and future, so a late answer finds no caller and is dropped, and a caller that leaves
sends CANCEL; when the connection ends, every pending call and open stream fails with ShuttingDown.

Split from remote.py, which builds on it: this module knows frames, ids and futures, not
what they carry. The calls the worker makes of the engine (remote_control.py) and its
inference and generation (remote.py `RemoteEngine`, which also reads the frames that
arrive: they reach every layer) are subclasses of `EngineChannel`, so the hot path reads the
same attributes of one object as before the split."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import orjson

from engine import errors
from server.link.frames import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameBuffer,
    Kind,
    Outbox,
    ProtocolError,
    frame,
)
from server.link.remote_generate import RemoteStream

log = logging.getLogger("sluice.worker")

FREE_DELAY_S = 0.002
"""Freed answer slots ride on the next frame to the engine, or go on their own after this long:
a frame of frees alone woke the engine process for nothing else (43% of its reads under HTTP
load, where a response is freed when it is sent, not when the next request is)."""

INFER_FLUSH_TURNS = 2
"""Requests go to the engine process a loop iteration later than other frames, so those that
reach the worker's loop an iteration apart share a frame and a wake-up of the engine process:
gRPC calls, which grpc.aio hands over an iteration apart, and HTTP requests whose bytes arrive
in the next poll. `versus --workers 2` against one iteration, 8 rounds
(loadtests/benchmarks/results/versus_flush_turns.md): 1.06x less CPU a request for the MLP over
JSON at 16 connections, 1.04x at 64, 1.06x over gRPC at 16 calls, 1.03x at one request at a
time (latency alike). Three iterations cost gRPC 1.11x more than two, JSON the same
(versus_flush_turns3.md)."""

NESTED = "a value nests lists or objects deeper than 254 levels"
"""Why a request cannot be passed to the engine: orjson's depth limit (the wire is JSON)."""


class EngineChannel:
    """The worker's connection to the engine process (see the module docstring)."""

    def __init__(self, path: str, index: int) -> None:
        self.path = path
        self.index = index
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, RemoteStream] = {}
        self._transport: asyncio.Transport | None = None
        self._welcome: asyncio.Future[Any] | None = None
        self._outbox = Outbox(Kind.INFER)  # requests framed together at the flush
        self._free_out: list[int] = []
        self._flush_scheduled = False
        self._frees_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_gone = asyncio.Event()
        self._closing = False

    async def _connect(self) -> Any:
        """Connect to the engine process as this worker slot; the engine's WELCOME."""
        self._loop = asyncio.get_running_loop()
        self._welcome = self._loop.create_future()
        transport, _ = await self._loop.create_unix_connection(
            lambda: _RemoteProtocol(self), self.path
        )
        self._transport = transport
        transport.write(frame(Kind.HELLO, {"worker": self.index}))
        return await self._welcome

    def _dispatch(self, kind: Kind, message: Any) -> None:
        """One frame from the engine (RemoteEngine's: what a frame carries reaches every layer)."""
        raise NotImplementedError

    # -- calls -----------------------------------------------------------------------------------

    async def _request(self, kind: Kind, message: dict[str, Any], what: str = "the call") -> Any:
        return await self._answer(*self._call(kind, message, what))

    def _call(
        self, kind: Kind, message: dict[str, Any], what: str
    ) -> tuple[int, asyncio.Future[Any]]:
        """Send `message` as a call whose answer resolves the future; the caller's error, with
        nothing sent or registered, when the channel cannot carry it (see `_encoded`)."""
        if self.engine_gone.is_set():
            raise errors.ShuttingDown("the engine process is gone")
        call_id = next(self._ids)
        message["id"] = call_id
        data = self._encoded(kind, message, what)
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = future
        self._outbox.add(data)
        self._schedule_flush()
        return call_id, future

    async def _answer(self, call_id: int, future: asyncio.Future[Any]) -> Any:
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(call_id, None) is not None:
                self._send(Kind.CANCEL, {"id": call_id})
            raise

    # -- the connection --------------------------------------------------------------------------

    def _send(self, kind: Kind, payload: Any) -> None:
        self._outbox.add(frame(kind, payload))
        self._schedule_flush()

    @staticmethod
    def _encoded(kind: Kind | None, payload: Any, what: str) -> bytes:
        """`payload` as a frame of `kind`, or as an item of a list frame with None (see
        frames.list_frames); or the client's error when the channel cannot carry it: a value
        JSON cannot hold (InvalidInput), or a frame past MAX_FRAME_BYTES (PayloadTooLarge), which
        the engine would take for a broken peer and end the connection every request of this
        worker shares. Tensors travel in the arena; what a frame carries is the rest of the
        request (parameters, id, output names, a prompt)."""
        try:
            body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:  # orjson: bytes, nesting past its depth limit, ...
            why = NESTED if "Recursion" in str(exc) else str(exc)
            raise errors.InvalidInput(
                f"{what} cannot be passed to the engine process: {why}"
            ) from None
        if kind is not None:
            size = len(body)
            data = HEADER.pack(size, kind) + body
        else:
            size, data = len(body) + 2, body  # the list frame's brackets
        if size > MAX_FRAME_BYTES:
            raise errors.PayloadTooLarge(
                size,
                MAX_FRAME_BYTES,
                message=f"{what} takes {size} bytes as a message to the engine process (its "
                f"tensors aside), more than the {MAX_FRAME_BYTES} bytes such a message may hold",
            )
        return data

    def _schedule_flush(self, turns: int = 1) -> None:
        """Write what is queued after `turns` loop iterations (1: once this iteration's tasks
        have run), in one write."""
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_later(0, self._flush_after, turns)

    def _flush_after(self, turns: int) -> None:
        if turns > 1 and self._loop is not None:
            self._loop.call_later(0, self._flush_after, turns - 1)
        else:
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._free_out:
            self._outbox.add(frame(Kind.FREE_OUT, {"slots": self._free_out}))
            self._free_out = []
            if self._frees_timer is not None:  # they ride on this flush: the timer would
                self._frees_timer.cancel()  # wake an idle worker for nothing
                self._frees_timer = None
        data = self._outbox.take()
        if data and self._transport is not None and not self.engine_gone.is_set():
            self._transport.write(data)

    def _free_out_slot(self, offset: int) -> None:
        self._free_out.append(offset)  # sent with the next flush, whatever starts it
        if self._frees_timer is None and self._loop is not None:
            self._frees_timer = self._loop.call_later(FREE_DELAY_S, self._send_frees)

    def _send_frees(self) -> None:
        self._frees_timer = None
        if self._free_out:  # nothing else went meanwhile
            self._schedule_flush()

    def _lost(self, reason: object) -> None:
        """The connection to the engine ended: every pending call fails, and so will new ones."""
        if not self._closing:
            log.error("lost the engine process: %s", reason)
        self.engine_gone.set()
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(ConnectionError(f"the engine process is gone: {reason}"))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(errors.ShuttingDown("the engine process is gone"))
        self._pending.clear()
        for stream in list(self._streams.values()):
            stream.fail(errors.ShuttingDown("the engine process is gone"))


class _RemoteProtocol(asyncio.Protocol):
    """The worker's end of its engine connection: frames dispatched as they arrive."""

    def __init__(self, remote: EngineChannel) -> None:
        self.remote = remote
        self.frames = FrameBuffer()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for kind, message in self.frames.feed(data):
                self.remote._dispatch(kind, message)
        except (ProtocolError, ValueError, TypeError, KeyError) as exc:
            assert self.transport is not None
            self.transport.close()
            self.remote._lost(f"protocol error: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.remote._lost(exc or "connection closed")
