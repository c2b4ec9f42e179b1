"""Generation on onnxruntime-genai's Engine: continuous batching, key/value buffers shared
between past and present, sampling, all in the library's C++.

One thread per model owns the `og.Engine` and every call on it (the library wants a request's
events drained before the request is touched again, so nothing else calls it): it starts the
turns the event loop submitted, closes the requests the loop gave up on (cancelled, stopped on a
stop string) so their cache is freed before the next step, and runs one `Engine.run` step at a
time. `Engine.run` lets go of the GIL while it computes, so the event loop keeps running; each
step's tokens are handed to the loop in one callback (coalesced while the loop is busy), where
the text, stop strings and finish reasons are worked out as for the hand-written scheduler
(engine/generation/scheduler.py).

What the Engine offers depends on the model: a model built with paged attention (CUDA, fp16 or
bf16) runs `engine.dynamic_batching` (paged cache, prefix caching, chunked prefill); every other
build runs `engine.static_batching`: in 0.18, batches of at most 4 requests in arrival order
(whatever `max_batch_size` says), each with a cache of the whole context, each batch run until
its longest request ends before the next starts; a closed request's place comes free only then
(tests/unit/engine/generation/test_genai.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import BackendError, EngineError, InvalidInput, Overloaded, ShuttingDown
from engine.generation.config import GenerativeOptions
from engine.generation.context import completion_budget
from engine.generation.emit import TokenSink
from engine.generation.sampling import SamplingParams
from engine.generation.sequence import FinishReason, GenSequence
from engine.generation.stats import GenerationStats
from engine.generation.text import Detokenizer

log = logging.getLogger("sluice.generation")

_START, _CLOSE, _STOP = "start", "close", "stop"


@dataclass(frozen=True, slots=True)
class CacheView:
    """The key/value cache as the metrics report it: the Engine allocates a whole context for
    each of its `batch` places, so bytes are reserved per running sequence."""

    sequence_bytes: int
    batch: int
    running: int

    @property
    def slot_bytes(self) -> int:
        return self.sequence_bytes * self.running

    @property
    def budget_bytes(self) -> int:
        return self.sequence_bytes * self.batch


@dataclass(slots=True)
class _Event:
    """What one Engine step gave one sequence, handed to the event loop."""

    sequence: GenSequence
    token: int | None
    finish: str | None = None  # the Engine's FinishReason name
    error: EngineError | None = None  # why a FAILED request failed, when the loop can say


class GenaiScheduler(TokenSink):
    """Runs the sequences of one onnxruntime-genai model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        options: GenerativeOptions,
        batch: int,
        sequence_bytes: int,
        label: str,
        stats: GenerationStats | None = None,
    ) -> None:
        import onnxruntime_genai as og

        self._og = og
        self._model = model  # an og.Model; its og.Engine is made on the Engine's thread
        self._engine: Any = None
        self.options = options
        self.batch = batch
        self.label = label
        self.sequence_bytes = sequence_bytes
        self.stats = stats or GenerationStats()  # the version's, kept across evictions
        self.prefix = None  # prefix reuse is the Engine's own, with a paged cache only
        self.live: list[GenSequence] = []  # admitted, not finished (loop side)
        self._commands: queue.SimpleQueue[tuple[str, GenSequence | None]] = queue.SimpleQueue()
        self._outbox: list[_Event] = []
        self._outbox_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = asyncio.Event()
        self._closed = False
        self.engine_requests = 0  # requests the Engine holds (thread side; read for tests)

    # -- the metrics' view -----------------------------------------------------------------------

    @property
    def running(self) -> list[GenSequence]:
        """Sequences that have had a token (the Engine's decode batch)."""
        return [s for s in self.live if s.last_token_at is not None]

    @property
    def waiting(self) -> list[GenSequence]:
        """Sequences the Engine has queued or is prefilling."""
        return [s for s in self.live if s.last_token_at is None]

    @property
    def cache(self) -> CacheView:
        return CacheView(self.sequence_bytes, self.batch, min(self.batch, len(self.live)))

    # -- requests, on the loop ---------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, detokenizer: Detokenizer | None = None
    ) -> GenSequence:
        """Queue a sequence. InvalidInput for an empty prompt, one the context cannot hold
        (max_tokens is clamped to the context) or a seed with sampling; Overloaded past
        `max_running_sequences` + `max_waiting_sequences` sequences in flight."""
        if self._closed:
            raise ShuttingDown()
        if not prompt:
            raise InvalidInput("the prompt is empty; it needs at least one token")
        if params.seed is not None and not params.greedy:
            # The Engine refuses it in begin_turn (a 500 then): sluice runs static batching.
            raise InvalidInput(
                f"seed is not supported by {self.label}: onnxruntime-genai's Engine takes a "
                "per-request seed only with dynamic batching, and this model runs static "
                "batching; leave seed out (or sample greedily, temperature 0)",
                "seed",
            )
        max_tokens = completion_budget(len(prompt), params.max_tokens, self.options.context_length)
        most = self.batch + self.options.max_waiting_sequences
        if len(self.live) >= most:
            raise Overloaded(
                f"{self.label} has {len(self.live)} sequences in flight ({self.batch} decoded "
                f"together, max_waiting_sequences {self.options.max_waiting_sequences} "
                "waiting); retry later"
            )
        sequence = GenSequence(list(prompt), params, max_tokens, detokenizer)
        self.live.append(sequence)
        self._ensure_thread()
        self._commands.put((_START, sequence))
        return sequence

    def cancel(self, sequence: GenSequence) -> None:
        """The client is gone: the stream ends now and the Engine's request is closed before
        its next step (its cache is free for the next sequence)."""
        if sequence.finish_reason is not None:
            return
        sequence.cancelled = True
        self._finish(sequence, "cancelled")

    async def drain(self) -> None:
        """Refuse new sequences; return once every accepted one has finished."""
        self._closed = True
        while self.live:
            self._idle.clear()
            await self._idle.wait()

    async def close(self) -> None:
        """Stop: every sequence not finished ends with ShuttingDown; the thread ends."""
        self._closed = True
        for sequence in list(self.live):
            self._finish(sequence, "error", ShuttingDown())
        thread = self._thread
        if thread is not None:
            self._commands.put((_STOP, None))
            await asyncio.to_thread(thread.join)

    # -- the Engine's thread -------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(
                target=self._run, name=f"genai {self.label}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        requests: dict[int, tuple[GenSequence, Any]] = {}  # id(og.Request) -> both
        by_sequence: dict[int, Any] = {}  # id(sequence) -> og.Request
        try:
            if self._engine is None:  # the library wants every Engine call on its own thread
                self._engine = self._og.Engine(self._model)
            buffer = self._engine.create_event_buffer(max(64, 4 * self.batch))
            while True:
                idle = not self._engine.has_pending_requests()
                failed: list[_Event] = []
                for kind, sequence in self._commands_now(block=idle):
                    if kind == _STOP:
                        return
                    assert sequence is not None
                    # One the loop ended before it started (cancelled, shut down) never starts.
                    if kind == _START and sequence.finish_reason is None:
                        request = self._begin(sequence, failed)
                        if request is not None:
                            requests[id(request)] = (sequence, request)
                            by_sequence[id(sequence)] = request
                    elif kind == _CLOSE and id(sequence) in by_sequence:
                        request = by_sequence.pop(id(sequence))
                        del requests[id(request)]
                        request.close()  # frees its cache now
                    self.engine_requests = len(requests)
                events = failed
                if self._engine.has_pending_requests():
                    events += self._step(buffer, requests, by_sequence)
                    self.engine_requests = len(requests)
                if events:
                    self._hand_over(events)
        except Exception:
            log.exception("%s: the onnxruntime-genai engine failed", self.label)
            self._engine = None  # the next sequence starts a new thread with a new Engine
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                    self._loop.call_soon_threadsafe(self._fail_all)
        finally:
            for _, request in requests.values():
                with contextlib.suppress(Exception):
                    request.close()
            self.engine_requests = 0

    def _commands_now(self, block: bool) -> list[tuple[str, GenSequence | None]]:
        """The commands queued now; when `block`, waits for the first one."""
        commands = [self._commands.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._commands.get_nowait())
        return commands

    def _begin(self, sequence: GenSequence, failed: list[_Event]) -> Any:
        """The sequence's Engine request with its turn begun, or None (a FAILED event in
        `failed`) when the library refuses it."""
        import numpy as np

        og, params = self._og, sequence.params
        request = self._engine.create_request()
        try:
            turn = og.TurnOptions(request)
            turn.set_max_generated_tokens(sequence.max_tokens)
            if params.greedy:
                turn.set_do_sample(False)
            else:
                turn.set_do_sample(True)
                turn.set_temperature(params.temperature)
                turn.set_top_k(params.top_k)  # 0: no top-k, as sluice's sampler means it
                turn.set_top_p(params.top_p)
                if params.seed is not None:
                    turn.set_seed(params.seed)
            if params.guidance is not None:
                turn.set_guidance(*params.guidance)
            request.begin_turn(np.asarray(sequence.prompt, dtype=np.int32), turn)
        except Exception as exc:
            request.close()
            # llguidance compiles the grammar in begin_turn: one it cannot is the client's.
            if params.guidance is not None and "grammar" in str(exc):
                refused = InvalidInput(f"the guided decoding cannot compile it: {exc}", "guidance")
                failed.append(_Event(sequence, None, "FAILED", refused))
                return None
            log.exception("%s: onnxruntime-genai refused a request", self.label)
            failed.append(_Event(sequence, None, "FAILED"))
            return None
        return request

    def _step(
        self,
        buffer: Any,
        requests: dict[int, tuple[GenSequence, Any]],
        by_sequence: dict[int, Any],
    ) -> list[_Event]:
        """One Engine step; a finished request is closed at once."""
        token_flag = int(self._og.EngineEventFlags.TOKEN)
        finished_flag = int(self._og.EngineEventFlags.TURN_FINISHED)
        failed_flag = int(self._og.EngineEventFlags.FAILED)
        events = []
        self.stats.steps += 1  # an int's increment: the loop thread only reads it
        for event in self._engine.run(buffer):
            found = requests.get(id(event.request))
            if found is None:
                continue  # a request closed since it was scheduled
            sequence, request = found
            flags = int(event.flags)
            token = int(event.token) if flags & token_flag else None
            finish = None
            if flags & failed_flag:
                finish = "FAILED"
                log.error(
                    "%s: onnxruntime-genai failed a request: %s", self.label, event.error_code
                )
            elif flags & finished_flag:
                finish = event.finish_reason.name
            if finish is not None:
                del requests[id(request)], by_sequence[id(sequence)]
                request.close()
            events.append(_Event(sequence, token, finish))
        return events

    def _hand_over(self, events: list[_Event]) -> None:
        """Queue events for the loop; one callback takes all that gather while it is busy."""
        with self._outbox_lock:
            scheduled = bool(self._outbox)
            self._outbox.extend(events)
        if not scheduled and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                self._loop.call_soon_threadsafe(self._deliver)

    # -- results, on the loop ------------------------------------------------------------------

    def _deliver(self) -> None:
        with self._outbox_lock:
            events, self._outbox = self._outbox, []
        now = time.monotonic()
        for event in events:
            sequence = event.sequence
            if event.token is not None:
                self._emit(sequence, event.token, now)
            if event.finish is not None and sequence.finish_reason is None:
                if event.finish == "FAILED":
                    failure = event.error or BackendError(
                        f"{self.label}: onnxruntime-genai failed the request"
                    )
                    self._finish(sequence, "error", failure)
                else:
                    self._finish(sequence, _REASONS.get(event.finish, "stop"))

    def _fail_all(self) -> None:
        """The Engine's thread failed: every sequence in flight ends with BackendError."""
        failure = BackendError(f"{self.label}: the onnxruntime-genai engine failed")
        for sequence in list(self.live):
            self._finish(sequence, "error", failure)

    def _release(self, sequence: GenSequence) -> None:
        with contextlib.suppress(ValueError):
            self.live.remove(sequence)
        # The Engine may still hold it (a stop string, a cancel): closed before its next step.
        if self._thread is not None and self._thread.is_alive():
            self._commands.put((_CLOSE, sequence))


_REASONS: dict[str, FinishReason] = {
    "EOS": "stop",
    "STOP_STRING": "stop",
    "MAX_GENERATED_TOKENS": "length",
    "MAX_SESSION_TOKENS": "length",
    "CANCELLED": "cancelled",
}
