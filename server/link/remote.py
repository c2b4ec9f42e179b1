"""The worker process's engine: `RemoteEngine` implements `engine.facade.EngineFacade` by talking
to the engine process (host.py), so the normal front-ends run unchanged in a worker.

Inference writes the decoded inputs once into this worker's in-arena (shm/), sends their
descriptors, and answers with arrays viewing the out-arena in place; the out-slot is freed when the
last of those arrays is gone (after the response is encoded). Authentication runs here (each worker
holds the keys); admission, the cache and the batchers are the engine process's.

Generation is relayed: `generate` sends the request the data plane passes on (authenticated
here) and returns a `RemoteStream` (remote_generate.py) fed by the engine's TOKENS frames
as they arrive; leaving it early sends CANCEL, and losing the engine ends every stream with
ShuttingDown.

The rest is in the layers `RemoteEngine` builds on: the connection itself, its frames and the
bookkeeping of each call (remote_channel.py), and the calls other than inference,
readiness, metadata, statistics, the repository, metrics (remote_control.py). This module
holds the requests in flight, which the drain waits for, and reads every frame the engine sends."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from engine import errors
from engine.auth import Authenticator
from engine.generation.service import GenerateRequest
from engine.tracing import Tracing, build_tracing, request_id
from engine.types import InferRequest, InferResponse
from server.link.frames import RESULT_ITEMS, Kind, ProtocolError
from server.link.remote_channel import INFER_FLUSH_TURNS
from server.link.remote_control import RemoteCheck, RemoteControl
from server.link.remote_generate import RemoteStream, rebuild_error
from server.link.remote_regions import WorkerRegions
from server.link.shm.allocator import Allocator
from server.link.shm.arena import Arena, SlotWatcher
from server.link.shm.layout import slot_bytes, view_tensors
from server.link.shm.placement import WRITE_OFF_LOOP_BYTES, place_now, place_tensors
from server.settings import Settings

IN_ARENA = "this worker's request arena"
"""How the in-arena is named where it is full or too small."""


class RemoteEngine(RemoteControl):
    """The engine facade of a worker process (see the module docstring)."""

    def __init__(
        self, settings: Settings, path: str, index: int, arenas: tuple[Arena, Arena]
    ) -> None:
        super().__init__(path, index)
        self.settings = settings
        self.inputs, self.outputs = arenas
        self.allocator = Allocator(self.inputs.size_bytes)
        self.authenticator = Authenticator(settings.auth)
        self.regions = WorkerRegions(
            settings.shared_memory, self.call, lambda: self._state, self._adopt_state
        )
        self.authenticator.on_reload.append(self.regions.keep_keys)
        self.tracing: Tracing | None = build_tracing(settings.tracing)
        self._infers = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._watcher: SlotWatcher | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def _adopt_state(self, state: dict[str, Any]) -> None:
        """The engine's state as a call answered it (newer than the last push, or the same)."""
        self._state = state
        self.regions.follow()

    async def start(self) -> None:
        """Connect to the engine process and take over this worker slot's arenas."""
        welcome = await self._connect()
        for offset, size in welcome["held"]:  # still read by the engine for our predecessor
            self.allocator.reserve(offset, size)
        self._state = welcome["state"]

    @property
    def live(self) -> bool:
        return not self.engine_gone.is_set()

    async def drain(self) -> None:
        """Wait for this worker's requests to be answered, bounded by `drain_timeout_s` (the
        engine answers what it cannot finish)."""
        self.stop_accepting()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s + 1.0):
                await self._idle.wait()

    async def close(self) -> None:
        self._closing = True
        self.regions.close()
        self.flush_events()
        self._flush()
        if self._transport is not None:
            self._transport.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # flushes spans: network, off the loop

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """The engine process's answer. Draining is the data plane's to refuse: a request it
        let in is sent, unless the connection it would go on is gone."""
        if self.engine_gone.is_set():  # nothing would answer it (as EngineChannel._call)
            raise errors.ShuttingDown("the engine process is gone")
        arrays = request.inputs
        size = slot_bytes(arrays)
        if size <= WRITE_OFF_LOOP_BYTES:  # no coroutine to place them: most requests
            offset, described = place_now(self.allocator, self.inputs, arrays, size, IN_ARENA)
        else:
            offset, size, described = await place_tensors(
                self.allocator, self.inputs, arrays, IN_ARENA, size
            )
            if self.engine_gone.is_set():  # while the tensors were copied
                self.allocator.free(offset)
                raise errors.ShuttingDown("the engine process is gone")
        call_id = next(self._ids)
        self._send_infer(call_id, offset, size, described, request)
        # From here the slot is the engine's until it says FREE_IN.
        assert self._loop is not None
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        self._pending[call_id] = future
        if not self._infers:
            self._idle.clear()
        self._infers += 1
        try:
            result = await future  # as _answer does, without its coroutine
        except asyncio.CancelledError:
            if self._pending.pop(call_id, None) is not None:
                self._send(Kind.CANCEL, {"id": call_id})
            raise
        finally:
            self._infers -= 1
            if not self._infers:
                self._idle.set()
        return self._response(result)

    def _send_infer(
        self, call_id: int, offset: int, size: int, described: Any, request: InferRequest
    ) -> None:
        """Queue the INFER frame item of a request whose inputs are in the in-slot at `offset`
        (one INFER frame for all of this flush's); a request never sent frees its slot."""
        # The check the data plane ran as it decoded the inputs: a model version's is trusted
        # by the engine while that version serves; none, or `unchecked` (on_demand, never
        # loaded), is not, and the engine checks the inputs itself.
        checked = request.checked
        version_id: int | None = None
        rows: object = None
        if checked is not None and type(checked.check) is RemoteCheck:
            version_id, rows = checked.check.version_id, checked.rows
        try:
            message = [  # frames.py INFER_ITEMS
                call_id,
                offset,
                size,
                described,
                request.model_name,
                request.datatypes,
                request.model_version,
                request.id,
                request.outputs,
                request.parameters,
                request.priority,
                request.timeout_s,
                request.arrived,  # CLOCK_MONOTONIC is the same in every process
                request.tenant,
                request_id.get(),  # the engine's log lines name it too
                # The engine's stage spans join this request's trace.
                None if self.tracing is None else self.tracing.traceparent(),
                version_id,
                rows,
            ]
            data = self._encoded(None, message, "the request")
        except BaseException:
            self.allocator.free(offset)  # never sent: the slot is still this worker's
            raise
        self._outbox.items.append(data)
        if not self._flush_scheduled:
            self._schedule_flush(INFER_FLUSH_TURNS)

    def _response(self, result: list[Any]) -> InferResponse:
        """The answer a RESULT frame item (frames.py RESULT_ITEMS) describes: arrays viewing its
        out-slot, which is freed once they are all gone."""
        _, at, nbytes, described, model_name, model_version, datatypes, id_, parameters = result
        slot = self.outputs.slot(at, nbytes)
        watcher = self._watcher
        if watcher is None:
            assert self._loop is not None
            watcher = self._watcher = SlotWatcher(self._loop, self._free_out_slot)
        watcher.watch(slot, at)
        outputs = view_tensors(slot, described)
        # Positional: keywords cost twice as much (the field order is InferResponse's).
        return InferResponse(model_name, model_version, outputs, datatypes, id_, parameters or {})

    # -- generation ------------------------------------------------------------------------------

    @property
    def generation(self) -> RemoteEngine:
        """A worker relays generation to the engine process (`generate`, and
        `generative_models` from the state the engine pushes): it is the Generation itself."""
        return self

    async def generate(self, request: GenerateRequest) -> RemoteStream:
        """Have the engine process admit and queue `request`; its chunks arrive on the stream.
        Draining is the data plane's to refuse, as for `infer`."""
        if self.engine_gone.is_set():
            raise errors.ShuttingDown("the engine process is gone")
        assert self._loop is not None
        stream_id = next(self._ids)
        message = {"id": stream_id, "request": request.to_wire(), "request_id": request_id.get()}
        data = self._encoded(Kind.GENERATE, message, "the generation request")
        stream = RemoteStream(stream_id, self._loop, self._stream_ended)
        self._streams[stream.id] = stream
        self._infers += 1  # a stream counts as a request in flight until it ends (drain)
        self._idle.clear()
        self._outbox.add(data)
        self._schedule_flush()
        try:
            await stream.started
        except BaseException:
            stream.cancel()  # refused (the engine's error), or our caller was cancelled
            raise
        return stream

    def _stream_ended(self, stream: RemoteStream, tell_engine: bool) -> None:
        if self._streams.pop(stream.id, None) is None:
            return
        if tell_engine and not self.engine_gone.is_set():
            self._send(Kind.CANCEL, {"id": stream.id})
        self._infers -= 1
        if not self._infers:
            self._idle.set()

    # -- frames from the engine ------------------------------------------------------------------

    def _dispatch(self, kind: Kind, message: Any) -> None:
        if kind is Kind.RESULT:  # lists (frames.py RESULT_ITEMS), checked before use
            if type(message) is not list:
                raise ProtocolError("a RESULT frame is a list of answers")
            pending = self._pending
            for answer in message:
                if type(answer) is not list or len(answer) != RESULT_ITEMS:
                    raise ProtocolError(f"an answer is a list of {RESULT_ITEMS} items")
                future = pending.pop(answer[0], None)
                if future is None or future.done():  # cancelled meanwhile: give its slot back
                    self._free_out_slot(answer[1])
                else:
                    future.set_result(answer)
            return
        call_id = message.get("id") if isinstance(message, dict) else None
        stream = self._streams.get(call_id) if type(call_id) is int else None
        if stream is not None and kind in (Kind.STREAM, Kind.TOKENS, Kind.ERROR):
            stream.on_frame(kind, message)
        elif kind in (Kind.STREAM, Kind.TOKENS):
            pass  # a stream this worker already left: the engine had sent these meanwhile
        elif kind is Kind.FREE_IN:
            for offset in message["slots"]:
                self.allocator.free(offset)
        elif kind in (Kind.REPLY, Kind.ERROR):
            future = self._pending.pop(message["id"], None)
            if future is None or future.done():  # the caller left meanwhile
                return
            if kind is Kind.ERROR:
                future.set_exception(rebuild_error(message))
            else:
                future.set_result(message["result"])
        elif kind is Kind.STATE:
            self._state = message
            self.regions.follow()
        elif kind is Kind.WELCOME and self._welcome is not None and not self._welcome.done():
            self._welcome.set_result(message)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from the engine")
