"""The engine process's side of the worker data plane: `EngineHost` serves the worker processes'
control connections (engine/wire.py) in front of one `Engine`, so admission, the result cache and
the batchers are the engine's own, shared by every worker.

A worker's inputs are viewed in place in its in-arena (engine/shm.py) and its answers written once
into its out-arena. When a worker's connection ends (the worker died or stopped) every request it
had in flight is cancelled (withdrawn from the batchers, its generations' cache slots freed at
the next step) and the out-slots it held are freed; the in-slots stay reserved until no array
views them, and a restarted worker is told which. Generation requests are served by the same
GenerationService the in-process routes call, their chunks sent back as TOKENS frames
(engine/host_generate.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from engine import errors
from engine.engine import Engine
from engine.generation.service import GenerateRequest, GenerationService
from engine.host_generate import relay_generation
from engine.metrics import WorkerArenas, WorkerCollector
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
from engine.tracing import request_id
from engine.types import InferRequest, InferResponse, ModelMetadata
from engine.wire import (
    HEADER,
    INFER_ITEMS,
    MAX_FRAME_BYTES,
    FrameBuffer,
    Kind,
    Outbox,
    ProtocolError,
    error_payload,
    frame,
)

log = logging.getLogger("sluice.host")

OUT_ARENA = "the worker's answer arena"
"""How a worker's out-arena is named where it is full or too small."""

STATE_INTERVAL_S = 0.1
"""How often the host looks for a change of readiness or of the loaded models to push."""


def metadata_payload(meta: ModelMetadata) -> dict[str, Any]:
    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": [[s.name, s.datatype, list(s.shape), list(s.dim_names)] for s in meta.inputs],
        "outputs": [[s.name, s.datatype, list(s.shape), list(s.dim_names)] for s in meta.outputs],
    }


@dataclass
class WorkerSlots:
    """One worker index's arenas; outlives the worker's processes (a restart reuses them)."""

    inputs: Arena
    outputs: Arena
    out_allocator: Allocator
    held_in: dict[int, int] = field(default_factory=dict)  # in-slots still viewed here
    connections: int = 0  # processes of this slot that said HELLO
    watcher: SlotWatcher | None = None
    peer: _Peer | None = None


class _Peer:
    """One worker connection: its in-flight requests and the frames waiting to be sent."""

    def __init__(
        self,
        transport: asyncio.Transport,
        slots: WorkerSlots,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.transport = transport
        self.loop = loop  # held: asyncio.get_running_loop() is a getpid() syscall per call
        self.slots = slots
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.out_slots: set[int] = set()
        self.closed = False
        self._outbox = Outbox(Kind.RESULT)  # answers framed together at the flush
        self._free_in: list[int] = []
        self._scheduled = False

    def send(self, kind: Kind, payload: Any) -> None:
        if self.closed:
            return
        body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)  # frame(), inline
        size = len(body)
        if size > MAX_FRAME_BYTES:
            call_id = payload.get("id") if isinstance(payload, dict) else None
            if type(call_id) is not int:
                log.error("not sent to a worker: a %s frame of %d bytes", kind.name, size)
                return
            self._too_large(call_id, size)
            return
        self._outbox.add(HEADER.pack(size, kind) + body)
        if not self._scheduled:
            self._schedule()

    def answer(
        self, call_id: int, offset: int, size: int, described: list[Any], response: InferResponse
    ) -> None:
        """Send the answer whose outputs were written to the out-slot at `offset`, in the next
        RESULT frame (engine/wire.py RESULT_ITEMS): the slot is the worker's until its FREE_OUT,
        or free again here when the answer cannot go."""
        out = self.slots.out_allocator
        if self.closed:  # nobody will read it: the worker went away while it was written
            out.free(offset)
            return
        try:
            body = orjson.dumps(
                [
                    call_id,
                    offset,
                    size,
                    described,
                    response.model_name,
                    response.model_version,
                    response.datatypes,
                    response.id,
                    response.parameters,
                ],
                option=orjson.OPT_SERIALIZE_NUMPY,
            )
        except BaseException:
            out.free(offset)
            raise
        if len(body) + 2 > MAX_FRAME_BYTES:  # with the list frame's brackets
            out.free(offset)
            self._too_large(call_id, len(body) + 2)
            return
        self.out_slots.add(offset)
        self._outbox.items.append(body)
        if not self._scheduled:
            self._schedule()

    def _too_large(self, call_id: int, size: int) -> None:
        # The worker would take the frame for a broken peer and end the connection every
        # request of the worker shares: the call it answers gets an error instead.
        failed = errors.BackendError(
            f"the engine process's answer takes {size} bytes, more than the "
            f"{MAX_FRAME_BYTES} bytes a message to a worker may hold"
        )
        self._outbox.add(frame(Kind.ERROR, error_payload(call_id, failed)))
        if not self._scheduled:
            self._schedule()

    def free_in(self, offset: int) -> None:
        self._free_in.append(offset)
        self._schedule()

    def _schedule(self) -> None:
        # One write for every frame of this loop iteration and the next: a batch's answers
        # resume their tasks in the next iteration, after a call_soon would already have run.
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_later(0, self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._free_in:
            self._outbox.add(frame(Kind.FREE_IN, {"slots": self._free_in}))
            self._free_in = []
        data = self._outbox.take()
        if data and not self.closed:
            self.transport.write(data)


class EngineHost:
    """Serves worker connections on a unix socket in front of `engine`."""

    def __init__(self, engine: Engine, arenas: Sequence[tuple[Arena, Arena]]) -> None:
        self.engine = engine
        self.generation = GenerationService(engine)
        self.workers = [WorkerSlots(i, o, Allocator(o.size_bytes)) for i, o in arenas]
        engine.metrics.registry.register(WorkerCollector(self.arenas))
        self._server: asyncio.Server | None = None
        self._peers: set[_Peer] = set()
        self._state: dict[str, Any] = {}
        self._state_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.no_workers = asyncio.Event()
        """Set while no worker is connected (the engine drains once its workers are gone)."""
        self.no_workers.set()

    def arenas(self) -> list[WorkerArenas]:
        """Each worker slot's arena use and restarts (read at scrape time)."""
        return [
            WorkerArenas(
                worker=index,
                in_used_bytes=sum(slots.held_in.values()),
                out_used_bytes=slots.out_allocator.used_bytes,
                arena_bytes=slots.outputs.size_bytes,
                connected=slots.peer is not None,
                restarts=max(0, slots.connections - 1),
            )
            for index, slots in enumerate(self.workers)
        ]

    async def serve(self, path: str) -> None:
        """Listen on `path` (returns once listening)."""
        self._loop = asyncio.get_running_loop()
        self._state = self.state()
        self._server = await self._loop.create_unix_server(lambda: _HostProtocol(self), path)
        self._state_task = asyncio.create_task(self._push_state(), name="host-state")

    async def close(self) -> None:
        if self._state_task is not None:
            self._state_task.cancel()
        if self._server is not None:
            self._server.close()
        for peer in list(self._peers):
            peer.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def state(self) -> dict[str, Any]:
        """What every worker keeps a copy of: whether the engine drains, which models are loaded
        (`generation` changes whenever a model is loaded, reloaded or unloaded)."""
        engine = self.engine
        models = engine.registry.all() if engine.live and _started(engine) else []
        index = engine.registry.index() if _started(engine) else []
        marks = orjson.dumps([index, [[m.name, m.version, m.generation] for m in models]])
        return {
            "draining": engine.draining,
            "models": sorted({m.name for m in models}),
            "generative": sorted({m.name for m in models if m.generator is not None}),
            "generation": zlib.crc32(marks),
            "server": engine.server_metadata(),
        }

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            state = self.state()
            if state != self._state:
                self._state = state
                for peer in self._peers:
                    peer.send(Kind.STATE, state)

    # -- connections -----------------------------------------------------------------------------

    def _welcome(self, transport: asyncio.Transport, index: object) -> _Peer:
        assert self._loop is not None  # connections arrive only once serve() has run
        if type(index) is not int or not 0 <= index < len(self.workers):
            raise ProtocolError(f"no worker slot {index!r}")
        slots = self.workers[index]
        if slots.peer is not None:  # the previous process of this slot is gone
            self._gone(slots.peer)
        peer = slots.peer = _Peer(transport, slots, self._loop)
        slots.connections += 1
        self._peers.add(peer)
        self.no_workers.clear()
        held = [[offset, size] for offset, size in slots.held_in.items()]
        peer.send(Kind.WELCOME, {"held": held, "state": self._state})
        return peer

    def _gone(self, peer: _Peer) -> None:
        """The worker went away: withdraw its requests and free what it held."""
        if peer.closed:
            return
        peer.closed = True
        self._peers.discard(peer)
        for call_id, task in peer.tasks.items():
            _cancel(peer, call_id, task)
        slots = peer.slots
        for offset in peer.out_slots:
            slots.out_allocator.free(offset)
        peer.out_slots.clear()
        if slots.peer is peer:
            slots.peer = None
        if all(w.peer is None for w in self.workers):
            self.no_workers.set()

    def _dispatch(self, peer: _Peer, kind: Kind, message: Any) -> None:
        if kind is Kind.INFER:
            if type(message) is not list:
                raise ProtocolError("an INFER frame is a list of requests")
            slots = peer.slots
            for request in message:
                self._infer(peer, slots, request)
        elif kind is Kind.CANCEL:
            task = peer.tasks.get(message["id"])
            if task is not None:
                _cancel(peer, message["id"], task)
        elif kind is Kind.FREE_OUT:
            for offset in message["slots"]:
                if offset in peer.out_slots:
                    peer.out_slots.discard(offset)
                    peer.slots.out_allocator.free(offset)
        elif kind is Kind.CALL:
            self._spawn(peer, message["id"], self._call(peer, message))
        elif kind is Kind.GENERATE:
            request = GenerateRequest.from_wire(message["request"])
            rid = message.get("request_id")
            rid = rid if isinstance(rid, str) else None
            work = relay_generation(self.generation, peer.send, message["id"], request, rid)
            self._spawn(peer, message["id"], work)
        elif kind is Kind.EVENTS:
            self._events(message)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame")

    def _spawn(self, peer: _Peer, call_id: int, work: Any) -> None:
        task = peer.loop.create_task(work)
        peer.tasks[call_id] = task
        task.add_done_callback(lambda done: _finished(peer, call_id, done))

    # -- inference -------------------------------------------------------------------------------

    def _infer(self, peer: _Peer, slots: WorkerSlots, message: object) -> None:
        if type(message) is not list or len(message) != INFER_ITEMS:
            raise ProtocolError(f"a request is a list of {INFER_ITEMS} items")
        (
            call_id,
            offset,
            size,
            described,
            model_name,
            datatypes,
            model_version,
            given_id,
            outputs,
            parameters,
            priority,
            timeout_s,
            arrived,
            tenant,
            rid,
            trace,
        ) = message
        if type(call_id) is not int:  # a key of peer.tasks: checked before its task exists
            raise ProtocolError(f"call id {call_id!r:.100} is not an integer")
        if type(offset) is not int or type(size) is not int:
            raise ProtocolError(f"in-slot {offset!r}+{size!r} is not a pair of integers")
        slot = slots.inputs.slot(offset, size)
        slots.held_in[offset] = size
        if slots.watcher is None:
            slots.watcher = SlotWatcher(peer.loop, lambda at: self._release_in(slots, at))
        slots.watcher.watch(slot, offset)
        try:
            inputs = view_tensors(slot, described)
        except ValueError as exc:
            peer.send(Kind.ERROR, error_payload(call_id, errors.InvalidInput(str(exc))))
            return
        del slot  # the arrays hold it now: when they are gone, the slot is free
        # Positional: keywords cost twice as much (the field order is InferRequest's).
        request = InferRequest(
            model_name,
            inputs,
            datatypes,
            model_version,
            given_id,
            outputs,
            parameters or {},
            priority,
            timeout_s,
            tenant,
            # A worker's time.monotonic() (the same clock in every process) if it is one; the
            # engine also refuses a time it cannot be (later than now, or an hour old).
            arrived if type(arrived) is float else None,
        )
        rid = rid if isinstance(rid, str) else None
        # No done callback (~1 µs a request): _answer forgets its task itself, and _cancel
        # adds _finished to a task it cancels.
        work = self._answer(peer, slots, call_id, request, rid, trace)
        peer.tasks[call_id] = peer.loop.create_task(work)

    def _release_in(self, slots: WorkerSlots, offset: int) -> None:
        slots.held_in.pop(offset, None)
        if slots.peer is not None:
            slots.peer.free_in(offset)

    async def _answer(
        self,
        peer: _Peer,
        slots: WorkerSlots,
        call_id: int,
        request: InferRequest,
        rid: str | None,
        trace: object,
    ) -> None:
        request_id.set(rid)  # this task's own context: no reset needed
        if self.engine.tracing is not None:
            self.engine.tracing.adopt(trace)  # the worker's request span is the parent
        try:
            response = await self.engine.infer(request)
            del request
            # Placed and sent here, not in a coroutine of its own (~0.5 µs a request).
            arrays = response.outputs
            out = slots.out_allocator
            size = slot_bytes(arrays)
            if size <= WRITE_OFF_LOOP_BYTES:
                offset, described = place_now(out, slots.outputs, arrays, size, OUT_ARENA)
            else:
                offset, size, described = await place_tensors(
                    out, slots.outputs, arrays, OUT_ARENA, size
                )
            peer.answer(call_id, offset, size, described, response)
        except errors.EngineError as exc:
            peer.send(Kind.ERROR, error_payload(call_id, exc))
        except Exception:
            log.exception("inference failed in the engine process")
            peer.send(Kind.ERROR, error_payload(call_id, errors.BackendError("internal error")))
        finally:
            peer.tasks.pop(call_id, None)

    # -- everything else -------------------------------------------------------------------------

    async def _call(self, peer: _Peer, message: dict[str, Any]) -> None:
        call_id, method, args = message["id"], message["method"], message.get("args") or []
        try:
            result = await self._method(method, args)
        except errors.EngineError as exc:
            peer.send(Kind.ERROR, error_payload(call_id, exc))
            return
        except Exception:
            log.exception("engine call %r failed", method)
            peer.send(Kind.ERROR, error_payload(call_id, errors.BackendError("internal error")))
            return
        peer.send(Kind.REPLY, {"id": call_id, "result": result})

    async def _method(self, method: str, args: list[Any]) -> Any:
        engine = self.engine
        if method == "model_metadata":
            return metadata_payload(await engine.model_metadata(*args))
        if method == "input_spec":
            model = engine.registry.resolve(*args)
            return {
                "inputs": [[s.name, s.datatype, list(s.shape)] for s in model.backend.inputs],
                "max_batch_size": model.max_batch_size,
                "label": model.label,
            }
        if method == "ready":
            return engine.ready
        if method == "model_ready":
            return await engine.model_ready(*args)
        if method == "model_config":
            return await engine.model_config(*args)
        if method == "statistics":
            return await engine.statistics(*args)
        if method == "repository_index":
            return await engine.repository_index(*args)
        if method == "load_model":
            await engine.load_model(args[0], args[1])
            return self._fresh_state()
        if method == "unload_model":
            await engine.unload_model(args[0], args[1])
            return self._fresh_state()
        if method == "usage":
            return await engine.usage(args[0])
        if method == "metrics":
            return (await engine.metrics.exposition()).decode()
        raise ProtocolError(f"unknown method {method!r}")

    def _fresh_state(self) -> dict[str, Any]:
        self._state = self.state()
        for peer in self._peers:
            peer.send(Kind.STATE, self._state)
        return self._state

    def _events(self, message: dict[str, Any]) -> None:
        """Front-end counts from a worker, added to the engine's metrics (one view)."""
        metrics = self.engine.metrics
        for model, version, protocol, status, seconds in message.get("requests", ()):
            metrics.request(str(model), str(version), str(protocol), int(status), float(seconds))
        for protocol, seconds in message.get("encoded", ()):
            metrics.encoded(str(protocol), float(seconds))


class _HostProtocol(asyncio.Protocol):
    """One worker connection: HELLO first, then frames dispatched as they arrive."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.frames = FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.peer: _Peer | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            for kind, message in self.frames.feed(data):
                if self.peer is None:
                    if kind is not Kind.HELLO or not isinstance(message, dict):
                        raise ProtocolError(f"expected HELLO, got {kind.name}")
                    self.peer = self.host._welcome(self.transport, message.get("worker"))
                elif self.peer.closed:
                    # A successor took this worker slot, welcomed with the in-slots held then:
                    # a request read now would hold one it may write into.
                    log.warning("frames of a replaced worker connection dropped; closing it")
                    self.transport.close()
                    return
                else:
                    self.host._dispatch(self.peer, kind, message)
        except (ProtocolError, ValueError, TypeError, KeyError) as exc:
            log.error("worker connection closed on a protocol error: %s", exc)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.host._gone(self.peer)


def _cancel(peer: _Peer, call_id: int, task: asyncio.Task[None]) -> None:
    """Cancel a call's task, and have it forgotten once it is done (an inference task forgets
    itself as it ends, but one cancelled before it started never runs) and its CancelledError
    taken (see _finished)."""
    task.cancel()
    task.add_done_callback(functools.partial(_finished, peer, call_id))


def _finished(peer: _Peer, call_id: int, task: asyncio.Task[None]) -> None:
    """Forget a finished call, and take a cancelled one's CancelledError from its task. A task
    keeps that error until someone asks for it, and the error can lead back to the task: one
    cancelled (its worker's CANCEL) while the request's deadline had already passed carries the
    batcher's TimeoutError as its context, whose traceback holds asyncio.timeout's frame, whose
    Timeout holds the task. Only the cyclic collector, which the engine process runs seldom
    (server.tune_gc), would free that cycle, and its frames hold the request's inputs: the
    worker's in-arena slots stayed taken until the arena was full and every request on the
    worker was refused 503."""
    peer.tasks.pop(call_id, None)
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()  # hands over (and drops) the task's reference to its CancelledError


def _started(engine: Engine) -> bool:
    try:
        engine.registry  # noqa: B018 - raises until started
    except RuntimeError:
        return False
    return True
