"""The worker process's engine: `RemoteEngine` implements `engine.facade.EngineFacade` by talking
to the engine process (engine/host.py), so the normal front-ends run unchanged in a worker.

Inference writes the decoded inputs once into this worker's in-arena (engine/shm.py), sends their
descriptors, and answers with arrays viewing the out-arena in place; the out-slot is freed when the
last of those arrays is gone (after the response is encoded). Authentication runs here (each worker
holds the keys); admission, the cache and the batchers are the engine process's.

Draining and which models are loaded are a copy the engine pushes when they change (within
STATE_INTERVAL_S); declared-shape checks are cached per model generation (the first request of a
model asks the engine, once however many arrive meanwhile). Readiness probes ask the engine
(`ready_now`), so every worker answers what one process would at that moment. Metadata,
configuration, statistics, the repository index and the metrics exposition are asked of the
engine too: each a CALL frame on this worker's one connection, its REPLY awaited (never a
blocking read: the worker's other requests, health probes and streams carry on while the engine
is slow), given up after CALL_TIMEOUT_S. Front-end request counts are sent to the engine in
batches, so `/metrics` from any worker shows every worker's requests.

Generation is relayed: `generate` sends the request the routes parsed (after authenticating
here) and returns a `RemoteStream` (engine/remote_generate.py) fed by the engine's TOKENS frames
as they arrive; leaving it early sends CANCEL, and losing the engine ends every stream with
ShuttingDown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from engine import errors
from engine.auth import Authenticator
from engine.generation.service import GenerateRequest
from engine.metrics import Metrics
from engine.remote_generate import RemoteStream, rebuild_error
from engine.settings import Settings
from engine.shm import (
    WRITE_OFF_LOOP_BYTES,
    Allocator,
    Arena,
    SlotWatcher,
    place_now,
    place_tensors,
    slot_bytes,
    view_tensors,
)
from engine.tracing import Tracing, build_tracing, request_id
from engine.types import InferRequest, InferResponse, ModelMetadata, TensorSpec
from engine.validate import InputCheck, check_inputs, check_load_parameters
from engine.wire import (
    HEADER,
    MAX_FRAME_BYTES,
    RESULT_ITEMS,
    FrameBuffer,
    Kind,
    Outbox,
    ProtocolError,
    frame,
)

log = logging.getLogger("sluice.worker")

EVENTS_INTERVAL_S = 0.05
"""Front-end counts reach the engine's metrics at most this long after the request."""

FREE_DELAY_S = 0.002
"""Freed answer slots ride on the next frame to the engine, or go on their own after this long:
a frame of frees alone woke the engine process for nothing else (43% of its reads under HTTP
load, where a response is freed when it is sent, not when the next request is)."""

NESTED = "a value nests lists or objects deeper than 254 levels"
"""Why a request cannot be passed to the engine: orjson's depth limit (the wire is JSON)."""

IN_ARENA = "this worker's request arena"
"""How the in-arena is named where it is full or too small."""

CALL_TIMEOUT_S = 10.0
"""A call to the engine (metadata, statistics, readiness...) is given up after this long: an
engine busy loading, overloaded or stopped answers its caller with an error, not never. Loads and
unloads are not bounded: they take as long as the model takes."""


CHECK_TRIES = 3
"""How often an input check is asked for while the loaded models keep changing under the call."""


def _specs(items: list[Any]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(item[0], item[1], tuple(item[2]), tuple(item[3]) if len(item) > 3 else ())
        for item in items
    )


class RemoteMetrics(Metrics):
    """Front-end counts go to the engine process; the exposition is the engine's (whole
    server's)."""

    def __init__(self, remote: RemoteEngine) -> None:
        super().__init__(dict)
        self._remote = remote
        self.pending_requests: list[list[Any]] = []
        self.pending_encoded: list[list[Any]] = []

    def request(self, model: str, version: str, protocol: str, status: int, seconds: float) -> None:
        self.pending_requests.append([model, version, protocol, status, seconds])
        self._remote.schedule_events()

    def encoded(self, protocol: str, seconds: float) -> None:
        self.pending_encoded.append([protocol, seconds])
        self._remote.schedule_events()

    def take(self) -> dict[str, list[list[Any]]] | None:
        """The counts not yet sent, or None."""
        if not (self.pending_requests or self.pending_encoded):
            return None
        taken = {"requests": self.pending_requests, "encoded": self.pending_encoded}
        self.pending_requests, self.pending_encoded = [], []
        return taken

    async def exposition(self) -> bytes:
        # This worker's counts go first on the same connection, so the answer includes them.
        return str(await self._remote.call("metrics", events=self.take())).encode()


class RemoteEngine:
    """The engine facade of a worker process (see the module docstring)."""

    def __init__(
        self, settings: Settings, path: str, index: int, arenas: tuple[Arena, Arena]
    ) -> None:
        self.settings = settings
        self.path = path
        self.index = index
        self.inputs, self.outputs = arenas
        self.allocator = Allocator(self.inputs.size_bytes)
        self.authenticator = Authenticator(settings.auth)
        self.tracing: Tracing | None = build_tracing(settings.tracing)
        self.metrics: Metrics = RemoteMetrics(self)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, RemoteStream] = {}
        self._infers = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._state: dict[str, Any] = {"draining": False, "models": []}
        self._checks: dict[tuple[str, str | None], InputCheck] = {}
        self._checks_generation: object = None
        self._fetching: dict[tuple[str, str | None], asyncio.Task[InputCheck]] = {}
        self._transport: asyncio.Transport | None = None
        self._welcome: asyncio.Future[Any] | None = None
        self._watcher: SlotWatcher | None = None
        self._outbox = Outbox(Kind.INFER)  # requests framed together at the flush
        self._free_out: list[int] = []
        self._flush_scheduled = False
        self._frees_timer: asyncio.TimerHandle | None = None
        self._events_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_gone = asyncio.Event()
        self._closing = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the engine process and take over this worker slot's arenas."""
        self._loop = asyncio.get_running_loop()
        self._welcome = self._loop.create_future()
        transport, _ = await self._loop.create_unix_connection(
            lambda: _RemoteProtocol(self), self.path
        )
        self._transport = transport
        transport.write(frame(Kind.HELLO, {"worker": self.index}))
        welcome = await self._welcome
        for offset, size in welcome["held"]:  # still read by the engine for our predecessor
            self.allocator.reserve(offset, size)
        self._state = welcome["state"]

    @property
    def live(self) -> bool:
        return not self.engine_gone.is_set()

    async def ready_now(self) -> bool:
        """Asked of the engine, on this worker's connection (the event loop is not blocked): the
        pushed copy lags a change by up to STATE_INTERVAL_S, longer while a load keeps the
        engine busy, where one process answers at once. Not ready without an answer within
        CALL_TIMEOUT_S. A probe affords the round trip; inference never asks."""
        if self.draining:
            return False
        try:
            ready = await self.call("ready")
        except errors.EngineError:  # the engine is gone, or did not answer in time
            return False
        return bool(ready) and not self.draining

    @property
    def draining(self) -> bool:
        return self._draining or bool(self._state.get("draining")) or self.engine_gone.is_set()

    def stop_accepting(self) -> None:
        self._draining = True

    async def drain(self) -> None:
        """Wait for this worker's requests to be answered, bounded by `drain_timeout_s` (the
        engine answers what it cannot finish)."""
        self.stop_accepting()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s + 1.0):
                await self._idle.wait()

    async def close(self) -> None:
        self._closing = True
        self.flush_events()
        self._flush()
        if self._transport is not None:
            self._transport.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # flushes spans: network, off the loop

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        if self.draining:
            raise errors.ShuttingDown()
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
        try:
            call_id = next(self._ids)
            message = [  # engine/wire.py INFER_ITEMS
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
            ]
            data = self._encoded(None, message, "the request")
        except BaseException:
            self.allocator.free(offset)  # never sent: the slot is still this worker's
            raise
        # From here the slot is the engine's until it says FREE_IN.
        assert self._loop is not None
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        self._pending[call_id] = future
        self._outbox.items.append(data)  # one INFER frame for all of this flush's
        if not self._flush_scheduled:
            self._schedule_flush()
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
        # The answer a RESULT frame (engine/wire.py RESULT_ITEMS) describes, here rather than
        # in a call of its own.
        _, at, nbytes, described, model_name, model_version, datatypes, id_, parameters = result
        slot = self.outputs.slot(at, nbytes)
        watcher = self._watcher
        if watcher is None:
            watcher = self._watcher = SlotWatcher(self._loop, self._free_out_slot)
        watcher.watch(slot, at)
        outputs = view_tensors(slot, described)
        # Positional: keywords cost twice as much (the field order is InferResponse's).
        return InferResponse(model_name, model_version, outputs, datatypes, id_, parameters or {})

    # -- generation ------------------------------------------------------------------------------

    def generative_models(self) -> list[str]:
        """The engine's generative models (from the state it pushes)."""
        return [str(name) for name in self._state.get("generative", ())]

    async def generate(self, request: GenerateRequest) -> RemoteStream:
        """Have the engine process admit and queue `request`; its chunks arrive on the stream."""
        if self.draining:
            raise errors.ShuttingDown()
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

    def _free_out_slot(self, offset: int) -> None:
        self._free_out.append(offset)  # sent with the next flush, whatever starts it
        if self._frees_timer is None and self._loop is not None:
            self._frees_timer = self._loop.call_later(FREE_DELAY_S, self._send_frees)

    def _send_frees(self) -> None:
        self._frees_timer = None
        if self._free_out:  # nothing else went meanwhile
            self._schedule_flush()

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
        wire.list_frames); or the client's error when the channel cannot carry it: a value
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

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_later(0, self._flush)  # after this iteration's tasks: one write

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

    def _dispatch(self, kind: Kind, message: Any) -> None:
        if kind is Kind.RESULT:  # lists (engine/wire.py RESULT_ITEMS), checked before use
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
        elif kind is Kind.WELCOME and self._welcome is not None and not self._welcome.done():
            self._welcome.set_result(message)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from the engine")

    # -- metrics ---------------------------------------------------------------------------------

    def schedule_events(self) -> None:
        if not self._events_scheduled and self._loop is not None:
            self._events_scheduled = True
            self._loop.call_later(EVENTS_INTERVAL_S, self.flush_events)

    def flush_events(self) -> None:
        self._events_scheduled = False
        metrics = self.metrics
        assert isinstance(metrics, RemoteMetrics)
        payload = metrics.take()
        if payload is not None and self._transport is not None:
            self._send(Kind.EVENTS, payload)
            self._flush()

    # -- everything else -------------------------------------------------------------------------

    async def call(self, method: str, *args: Any, events: dict[str, Any] | None = None) -> Any:
        """The engine's answer to `method(*args)` (engine/host.py), awaited on this worker's
        connection. None within CALL_TIMEOUT_S is Overloaded (503 with Retry-After: the engine
        is slow or stopped, not broken) naming the call; the call is withdrawn, and a late answer
        finds no caller and is dropped, never taken for another call's. `events` (front-end
        counts) go in a frame just before the call's, so the engine has counted them when it
        answers."""
        if events is not None:
            self._send(Kind.EVENTS, events)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await self._request(Kind.CALL, {"method": method, "args": list(args)})
        except TimeoutError:
            raise errors.Overloaded(
                f"the engine process did not answer '{method}' within {CALL_TIMEOUT_S:g} s; "
                "retry shortly"
            ) from None

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck | None:
        """The check fetched for this model generation, or None (then await `input_check`)."""
        return self._current_checks().get((name, version))

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        """The declared-shape check of (name, version), asked of the engine on a miss. Requests
        that miss together wait for one call: a burst on a model's first use (or after a load)
        asks once, and a caller that leaves (its client went away) does not fail the others."""
        key = (name, version)
        check = self._current_checks().get(key)
        if check is not None:
            return check
        fetch = self._fetching.get(key)
        if fetch is None:
            assert self._loop is not None
            fetch = self._fetching[key] = self._loop.create_task(self._fetch_check(name, version))
            fetch.add_done_callback(functools.partial(self._fetched, key))
        return await asyncio.shield(fetch)

    def _current_checks(self) -> dict[tuple[str, str | None], InputCheck]:
        """The cached checks, emptied when the engine's models changed (a new generation)."""
        generation = self._state.get("generation")
        if generation != self._checks_generation:
            self._checks.clear()
            self._checks_generation = generation
        return self._checks

    async def _fetch_check(self, name: str, version: str | None) -> InputCheck:
        """The check as the engine answers it, kept for the generation it answered in. The
        engine computes an answer before any state push it sends after it, but the worker may
        read both at once (its loop was busy) and take the push first: a generation that
        changed while the call was out may have been answered with the model it replaced, so
        it is asked again rather than kept under the new generation."""
        for _ in range(CHECK_TRIES):
            asked_in = self._state.get("generation")
            spec = await self.call("input_spec", name, version)
            check: InputCheck = functools.partial(
                check_inputs,
                inputs=_specs(spec["inputs"]),
                max_batch_size=spec["max_batch_size"],
                label=spec["label"],
            )
            if self._state.get("generation") == asked_in:
                self._current_checks()[(name, version)] = check
                break
        return check  # models changing all along: the last answer, used once, not kept

    def _fetched(self, key: tuple[str, str | None], fetch: asyncio.Task[InputCheck]) -> None:
        if self._fetching.get(key) is fetch:
            del self._fetching[key]
        if not fetch.cancelled():
            fetch.exception()  # retrieved: its callers may all have left (asyncio would log it)

    def server_metadata(self) -> dict[str, Any]:
        return dict(self._state.get("server") or {})

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        meta = await self.call("model_metadata", name, version)
        return ModelMetadata(
            name=meta["name"],
            versions=tuple(meta["versions"]),
            platform=meta["platform"],
            inputs=_specs(meta["inputs"]),
            outputs=_specs(meta["outputs"]),
        )

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return bool(await self.call("model_ready", name, version)) and not self.draining

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("model_config", name, version)
        return result

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("statistics", name, version)
        return result

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        result: list[dict[str, str]] = await self.call("repository_index", ready_only)
        return result

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        # Refused here as the engine would refuse them: what passes is names and a config text,
        # which the channel carries (a value it cannot, bytes or deep nesting, never reaches it).
        check_load_parameters(parameters)
        # The values go too: Triton's `config` parameter carries the model config.
        given = dict(parameters) if isinstance(parameters, Mapping) else list(parameters)
        self._state = await self._request(
            Kind.CALL, {"method": "load_model", "args": [name, given]}
        )

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        self._state = await self._request(
            Kind.CALL, {"method": "unload_model", "args": [name, list(parameters)]}
        )

    async def usage(self, tenant: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("usage", tenant)
        return result

    def label_for(self, name: str) -> str:
        return name if name in self._state.get("models", ()) else "_unknown"


class _RemoteProtocol(asyncio.Protocol):
    """The worker's end of its engine connection: frames dispatched as they arrive."""

    def __init__(self, remote: RemoteEngine) -> None:
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
