"""The engine process's side of the worker data plane: `EngineHost` serves the worker processes'
control connections (frames.py) in front of one `Engine`, so admission, the result cache and
the batchers are the engine's own, shared by every worker.

A worker's inputs are viewed in place in its in-arena (shm/) and its answers written once
into its out-arena. When a worker's connection ends (the worker died or stopped) every request it
had in flight is cancelled (withdrawn from the batchers, its generations' cache slots freed at
the next step) and the out-slots it held are freed; the in-slots stay reserved until no array
views them, and a restarted worker is told which. Generation requests are served by the same
GenerationService the in-process routes call, their chunks sent back as TOKENS frames
(host_generate.py).

This module holds the connections (HELLO, a worker slot's successor, a worker gone), the frames
read from them and inference; it builds on `HostControl` (host_control.py: state pushes,
the calls other than inference, front-end counts), and each connection's outgoing frames and
calls in flight are a `Peer`'s (host_peer.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, cast

from engine import errors
from engine.engine import Engine
from engine.generation.service import GenerateRequest
from engine.metrics import WorkerArenas, WorkerCollector
from engine.tracing import request_id
from engine.types import InferRequest
from server.link.frames import INFER_ITEMS, FrameBuffer, Kind, ProtocolError, error_payload
from server.link.host_control import HostControl
from server.link.host_generate import relay_generation
from server.link.host_peer import Peer, WorkerSlots, call_finished, cancel_call
from server.link.shm.allocator import Allocator
from server.link.shm.arena import Arena, SlotWatcher
from server.link.shm.layout import slot_bytes, view_tensors
from server.link.shm.placement import WRITE_OFF_LOOP_BYTES, place_now, place_tensors

log = logging.getLogger("sluice.host")

OUT_ARENA = "the worker's answer arena"
"""How a worker's out-arena is named where it is full or too small."""


class EngineHost(HostControl):
    """Serves worker connections on a unix socket in front of `engine`."""

    def __init__(self, engine: Engine, arenas: Sequence[tuple[Arena, Arena]]) -> None:
        super().__init__(engine)
        self.generation = engine.generation
        self.workers = [WorkerSlots(i, o, Allocator(o.size_bytes)) for i, o in arenas]
        engine.metrics.registry.register(WorkerCollector(self.arenas))
        self._server: asyncio.Server | None = None
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

    # -- connections -----------------------------------------------------------------------------

    def _welcome(self, transport: asyncio.Transport, index: object) -> Peer:
        assert self._loop is not None  # connections arrive only once serve() has run
        if type(index) is not int or not 0 <= index < len(self.workers):
            raise ProtocolError(f"no worker slot {index!r}")
        slots = self.workers[index]
        if slots.peer is not None:  # the previous process of this slot is gone
            self._gone(slots.peer)
        peer = slots.peer = Peer(transport, slots, self._loop)
        slots.connections += 1
        self._peers.add(peer)
        self.no_workers.clear()
        held = [[offset, size] for offset, size in slots.held_in.items()]
        peer.send(Kind.WELCOME, {"held": held, "state": self._state})
        return peer

    def _gone(self, peer: Peer) -> None:
        """The worker went away: withdraw its requests and free what it held."""
        if peer.closed:
            return
        peer.closed = True
        self._peers.discard(peer)
        for call_id, task in peer.tasks.items():
            cancel_call(peer, call_id, task)
        slots = peer.slots
        for offset in peer.out_slots:
            slots.out_allocator.free(offset)
        peer.out_slots.clear()
        if slots.peer is peer:
            slots.peer = None
        if all(w.peer is None for w in self.workers):
            self.no_workers.set()

    def _dispatch(self, peer: Peer, kind: Kind, message: Any) -> None:
        if kind is Kind.INFER:
            if type(message) is not list:
                raise ProtocolError("an INFER frame is a list of requests")
            slots = peer.slots
            for request in message:
                self._infer(peer, slots, request)
        elif kind is Kind.CANCEL:
            task = peer.tasks.get(message["id"])
            if task is not None:
                cancel_call(peer, message["id"], task)
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

    def _spawn(self, peer: Peer, call_id: int, work: Any) -> None:
        task = peer.loop.create_task(work)
        peer.tasks[call_id] = task
        task.add_done_callback(lambda done: call_finished(peer, call_id, done))

    # -- inference -------------------------------------------------------------------------------

    def _infer(self, peer: Peer, slots: WorkerSlots, message: object) -> None:
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
            checked_version,
            rows,
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
        # What the worker's input check established, trusted while its version serves.
        request.checked = self.checked(checked_version, rows, model_version)
        rid = rid if isinstance(rid, str) else None
        # No done callback (~1 µs a request): _answer forgets its task itself, and cancel_call
        # adds call_finished to a task it cancels.
        work = self._answer(peer, slots, call_id, request, rid, trace)
        peer.tasks[call_id] = peer.loop.create_task(work)

    def _release_in(self, slots: WorkerSlots, offset: int) -> None:
        slots.held_in.pop(offset, None)
        if slots.peer is not None:
            slots.peer.free_in(offset)

    async def _answer(
        self,
        peer: Peer,
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


class _HostProtocol(asyncio.Protocol):
    """One worker connection: HELLO first, then frames dispatched as they arrive."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.frames = FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None

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
