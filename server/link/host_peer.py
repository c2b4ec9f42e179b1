"""The engine process's end of one worker connection: `Peer` queues the frames that go to that
worker, one write per loop iteration (its answers framed together in RESULT frames, the in-slots
the engine no longer reads in FREE_IN), and holds the tasks of the calls in flight for it, which
`cancel_call` and `call_finished` withdraw and forget; `WorkerSlots` are a worker index's arenas,
which outlive its processes.

Split from host.py: this is what one connection holds and sends, apart from what
`EngineHost` does with the frames it reads (host.py) and the calls it answers
(host_control.py), which both hand their answers to a `Peer`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine import errors
from engine.types import InferResponse
from server.link.frames import HEADER, MAX_FRAME_BYTES, Kind, Outbox, error_payload, frame
from server.link.shm.allocator import Allocator
from server.link.shm.arena import Arena, SlotWatcher

log = logging.getLogger("sluice.host")


@dataclass
class WorkerSlots:
    """One worker index's arenas; outlives the worker's processes (a restart reuses them)."""

    inputs: Arena
    outputs: Arena
    out_allocator: Allocator
    held_in: dict[int, int] = field(default_factory=dict)  # in-slots still viewed here
    connections: int = 0  # processes of this slot that said HELLO
    watcher: SlotWatcher | None = None
    peer: Peer | None = None


class Peer:
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
        RESULT frame (frames.py RESULT_ITEMS): the slot is the worker's until its FREE_OUT,
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


def cancel_call(peer: Peer, call_id: int, task: asyncio.Task[None]) -> None:
    """Cancel a call's task, and have it forgotten once it is done (an inference task forgets
    itself as it ends, but one cancelled before it started never runs) and its CancelledError
    taken (see call_finished)."""
    task.cancel()
    task.add_done_callback(functools.partial(call_finished, peer, call_id))


def call_finished(peer: Peer, call_id: int, task: asyncio.Task[None]) -> None:
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
