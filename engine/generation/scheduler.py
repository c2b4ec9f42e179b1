"""The iteration-level (continuous batching) scheduler of one generative model.

One owner task runs steps. Each step: drop cancelled sequences (their cache slots are freed
there), admit waiting sequences in arrival order while the cache budget and the decode batch
have room, prefill at most `prefill_chunk_tokens` prompt tokens of the sequences still being
prefilled (a long prompt takes several steps, so it never stalls the running streams for long),
and run one decode step of every other running sequence as one batch: their caches padded to
the longest with attention_mask zeros over the padding, each at its own position. Each
sequence samples its next token with its own sampler; finished sequences leave at once and new
ones join at the next step.

The sequences' state is engine/generation/sequence.py's; the decoder runs of a step are
engine/generation/decoder.py's."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor

from engine.errors import (
    BackendError,
    EngineError,
    InvalidInput,
    Overloaded,
    ShuttingDown,
)
from engine.generation.config import GenerativeOptions
from engine.generation.context import completion_budget
from engine.generation.decoder import RunDecoder, SlotDecoder
from engine.generation.emit import TokenSink
from engine.generation.kv_cache import CacheLayout, KVCacheManager
from engine.generation.prefix_cache import PrefixCache
from engine.generation.sampling import SamplingParams
from engine.generation.sequence import GenSequence
from engine.generation.stats import GenerationStats
from engine.generation.text import Detokenizer

log = logging.getLogger("sluice.generation")


class GenerationScheduler(TokenSink):
    """Runs the sequences of one generative model (see the module docstring)."""

    def __init__(
        self,
        run: RunDecoder,
        layout: CacheLayout,
        options: GenerativeOptions,
        executor: Executor,
        label: str,
        stats: GenerationStats | None = None,
    ) -> None:
        self._decoder = SlotDecoder(run, layout)
        self.layout = layout
        self.options = options
        self._executor = executor
        self.label = label
        self.cache = KVCacheManager(layout, options.kv_cache_bytes)
        self.prefix = (
            PrefixCache(self.cache, options.prefix_block_tokens) if options.prefix_caching else None
        )
        self.stats = stats or GenerationStats()  # the version's, kept across evictions
        self.waiting: deque[GenSequence] = deque()
        self.running: list[GenSequence] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set when a sequence finishes (drain re-checks)
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, detokenizer: Detokenizer | None = None
    ) -> GenSequence:
        """Queue a sequence (its stream starts once it is admitted). A prompt that does not fit
        the context is InvalidInput naming both lengths; max_tokens is clamped to the context
        (the finish reason is then `length`; engine/generation/context.py); a full waiting
        queue is Overloaded."""
        if self._closed:
            raise ShuttingDown()
        if not prompt:
            raise InvalidInput("the prompt is empty; it needs at least one token")
        max_tokens = completion_budget(len(prompt), params.max_tokens, self.options.context_length)
        if not self.cache.fits_ever(len(prompt) + max_tokens):
            need = self.cache.bytes_for(len(prompt) + max_tokens)
            raise InvalidInput(
                f"{len(prompt)} prompt + {max_tokens} completion tokens need {need} bytes of "
                f"key/value cache; kv_cache_bytes is {self.options.kv_cache_bytes}"
            )
        sequence = GenSequence(list(prompt), params, max_tokens, detokenizer)
        self.waiting.append(sequence)
        # Counted with the new one: one that the next step starts does not wait (so even
        # max_waiting_sequences 0 serves a model with room).
        if len(self.waiting) - self._startable() > self.options.max_waiting_sequences:
            self.waiting.pop()
            raise Overloaded(
                f"{self.label} has {len(self.waiting)} sequences waiting for cache room "
                f"(max_waiting_sequences {self.options.max_waiting_sequences}); retry later"
            )
        self._ensure_task()
        self._wake.set()
        return sequence

    def cancel(self, sequence: GenSequence) -> None:
        """The client is gone: the slot is freed at the next step (or now, if waiting)."""
        if sequence.finish_reason is not None:
            return
        sequence.cancelled = True
        with contextlib.suppress(ValueError):
            self.waiting.remove(sequence)
            self._finish(sequence, "cancelled")
        self._wake.set()

    async def drain(self) -> None:
        """Refuse new sequences and return once every accepted one has finished (bound it with
        a timeout; close() then ends the rest)."""
        self._closed = True
        while self.waiting or self.running:
            self._idle.clear()
            await self._idle.wait()

    async def close(self) -> None:
        """Stop: every sequence not yet finished ends with ShuttingDown."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sequence in [*self.waiting, *self.running]:
            self._finish(sequence, "error", ShuttingDown())
        self.waiting.clear()
        self.running.clear()

    # -- the owner task ------------------------------------------------------------------------

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name=f"generate {self.label}")
            self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A bug that ended the owner task must not leave streams waiting forever: every
        accepted sequence is answered BackendError (the next submit starts a new task)."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: the generation scheduler failed", self.label, exc_info=task.exception())
        failure = BackendError(f"{self.label}: generation scheduler failed")
        self._fail([*self.waiting, *self.running], failure)
        self.waiting.clear()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._retire_cancelled()
            self._admit()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = self._prefill_plan()
            decode = [s for s in self.running if s.prefilled and s not in dict(prefill)]
            try:
                logits = await loop.run_in_executor(
                    self._executor, self._decoder.step, prefill, decode
                )
            except EngineError as exc:
                self._fail([s for s, _ in prefill] + decode, exc)
                continue
            except Exception as exc:
                log.exception("%s: a generation step failed", self.label)
                failure = BackendError(f"{self.label}: generation step failed")
                failure.__cause__ = exc
                self._fail([s for s, _ in prefill] + decode, failure)
                continue
            if self.prefix is not None:
                for sequence, _ in prefill:
                    if sequence.prefilled and sequence.slot is not None:
                        self.prefix.store(sequence.prompt, sequence.slot)
            now = time.monotonic()
            for sequence, row in logits:
                try:
                    token = sequence.sampler(row)
                except ValueError as exc:  # NaN logits: this sequence fails, the others go on
                    log.error("%s: cannot sample from the logits: %s", self.label, exc)
                    failure = BackendError(f"{self.label}: the model gave logits with no token")
                    self._finish(sequence, "error", failure)
                    continue
                self._emit(sequence, token, now)
            self.stats.steps += 1

    def _retire_cancelled(self) -> None:
        for sequence in [s for s in self.running if s.cancelled]:
            self._finish(sequence, "cancelled")

    def _startable(self) -> int:
        """How many waiting sequences the next step starts (free running places and cache room,
        cached prefixes yielding as `_admit` makes them): those are not left waiting, so a burst
        submitted between two steps is not refused by an idle model."""
        places = self.options.max_running_sequences - len(self.running)
        room = self.cache.free_bytes + (self.prefix.bytes if self.prefix is not None else 0)
        started = 0
        for sequence in itertools.islice(self.waiting, max(0, places)):
            need = self.cache.bytes_for(len(sequence.prompt) + sequence.max_tokens)
            if need > room:
                break
            room -= need
            started += 1
        return started

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.options.max_running_sequences:
            sequence = self.waiting[0]
            tokens = len(sequence.prompt) + sequence.max_tokens
            need = self.cache.bytes_for(tokens)
            if self.prefix is not None and self.cache.budget_bytes - self.cache.slot_bytes >= need:
                self.prefix.evict(need)  # cached prefixes yield to sequences, when that helps
            slot = self.cache.reserve(tokens)
            if slot is None:
                return  # first come, first served: a small one does not overtake
            self.waiting.popleft()
            if self.prefix is not None:
                self.prefix.fill(sequence.prompt, slot)
            sequence.slot = slot
            self.running.append(sequence)

    def _prefill_plan(self) -> list[tuple[GenSequence, int]]:
        """(sequence, tokens to prefill now) within this step's prefill budget."""
        budget = self.options.prefill_chunk_tokens
        plan = []
        for sequence in self.running:
            if budget == 0:
                break
            if sequence.prefilled:
                continue
            assert sequence.slot is not None
            tokens = min(budget, len(sequence.prompt) - sequence.slot.length)
            plan.append((sequence, tokens))
            budget -= tokens
        return plan

    # -- results, on the loop ------------------------------------------------------------------

    def _release(self, sequence: GenSequence) -> None:
        if sequence.slot is not None:
            self.cache.release(sequence.slot)
        with contextlib.suppress(ValueError):
            self.running.remove(sequence)
        self._wake.set()

    def _fail(self, sequences: list[GenSequence], error: EngineError) -> None:
        for sequence in sequences:
            self._finish(sequence, "error", error)
