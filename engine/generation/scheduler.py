"""The iteration-level (continuous batching) scheduler of one generative model.

One owner task runs steps. Each step: drop cancelled sequences (their cache slots are freed
there), admit waiting sequences in arrival order while the cache budget and the decode batch
have room, prefill at most `prefill_chunk_tokens` prompt tokens of the sequences still being
prefilled (a long prompt takes several steps, so it never stalls the running streams for long),
and run one decode step of every other running sequence as one batch: their caches padded to
the longest with attention_mask zeros over the padding, each at its own position. Each
sequence samples its next token with its own sampler; finished sequences leave at once and new
ones join at the next step.

The decoder contract is converters/causal_lm.py's (past key/values in, present out)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from engine.errors import (
    BackendError,
    EngineError,
    InvalidInput,
    Overloaded,
    ShuttingDown,
)
from engine.generation.config import GenerativeOptions
from engine.generation.context import completion_budget
from engine.generation.kv_cache import CacheLayout, KVCacheManager, Slot
from engine.generation.prefix_cache import PrefixCache
from engine.generation.sampling import Sampler, SamplingParams
from engine.generation.stats import GenerationStats
from engine.generation.text import Detokenizer

log = logging.getLogger("sluice.generation")

RunDecoder = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(slots=True)
class Chunk:
    """What one step gave a sequence: new tokens, their final text, and the finish reason
    once it is done (`error` carries the engine error)."""

    tokens: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: EngineError | None = None


@dataclass(eq=False)
class GenSequence:
    """One request's generation: its prompt, sampling, cache slot and output stream."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    detokenizer: Detokenizer | None
    sampler: Sampler = field(init=False)
    events: asyncio.Queue[Chunk] = field(default_factory=asyncio.Queue)
    slot: Slot | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def prefilled(self) -> bool:
        return self.slot is not None and self.slot.length >= len(self.prompt)

    async def stream(self) -> AsyncIterator[Chunk]:
        """Chunks until the one with a finish reason (included)."""
        while True:
            chunk = await self.events.get()
            yield chunk
            if chunk.finish_reason is not None:
                return


class GenerationScheduler:
    """Runs the sequences of one generative model (see the module docstring)."""

    def __init__(
        self,
        run: RunDecoder,
        layout: CacheLayout,
        options: GenerativeOptions,
        executor: Executor,
        label: str,
    ) -> None:
        self._run = run
        self.layout = layout
        self.options = options
        self._executor = executor
        self.label = label
        self.cache = KVCacheManager(layout, options.kv_cache_bytes)
        self.prefix = (
            PrefixCache(self.cache, options.prefix_block_tokens) if options.prefix_caching else None
        )
        self.stats = GenerationStats()
        self.waiting: deque[GenSequence] = deque()
        self.running: list[GenSequence] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set when a sequence finishes (drain re-checks)
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._past_names = [
            f"past_key_values.{i}.{kv}" for i in range(layout.layers) for kv in ("key", "value")
        ]
        self._present_names = [
            f"present.{i}.{kv}" for i in range(layout.layers) for kv in ("key", "value")
        ]

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
                logits = await loop.run_in_executor(self._executor, self._step, prefill, decode)
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

    # -- one step, in a worker thread ----------------------------------------------------------

    def _step(
        self, prefill: list[tuple[GenSequence, int]], decode: list[GenSequence]
    ) -> list[tuple[GenSequence, np.ndarray]]:
        """Run the prefill chunks (one batch) and the decode batch; the logits of every
        sequence that has a next token to sample (a prefill that reached the prompt's end,
        every decode)."""
        rows = []
        if prefill:
            slots = [s.slot for s, _ in prefill if s.slot is not None]
            chunks = [
                s.prompt[slot.length : slot.length + n]
                for (s, n), slot in zip(prefill, slots, strict=True)
            ]
            logits = self._forward(slots, chunks)
            for (sequence, _), row in zip(prefill, logits, strict=True):
                if sequence.prefilled:
                    rows.append((sequence, row))
        if decode:
            slots = [s.slot for s in decode if s.slot is not None]
            logits = self._forward(slots, [[s.generated[-1]] for s in decode])
            rows += list(zip(decode, logits, strict=True))
        return rows

    def _forward(self, slots: list[Slot], ids: list[list[int]]) -> np.ndarray:
        """One decoder run: row b feeds `ids[b]` after the `slots[b].length` positions cached
        in its slot. Rows are padded to the longest past (on the left of the new tokens) and
        the longest `ids` (on the right), attention_mask hiding both paddings; each row keeps
        its own positions. Writes the new keys/values into the slots; returns each row's
        logits at its last real token."""
        starts = [slot.length for slot in slots]
        lengths = [len(row) for row in ids]
        batch, new, past = len(slots), max(lengths), max(starts)
        mask = np.zeros((batch, past + new), np.int64)
        tokens = np.zeros((batch, new), np.int64)
        positions = np.zeros((batch, new), np.int64)
        for b, (start, length, row) in enumerate(zip(starts, lengths, ids, strict=True)):
            mask[b, :start] = 1
            mask[b, past : past + length] = 1
            tokens[b, :length] = row
            # Padding takes a real position (its outputs are discarded): never past the table.
            positions[b] = start + np.minimum(np.arange(new), length - 1)
        feed: dict[str, np.ndarray] = {
            "input_ids": tokens,
            "attention_mask": mask,
            "position_ids": positions,
        }
        layout = self.layout
        for j, name in enumerate(self._past_names):
            tensor = np.zeros((batch, layout.kv_heads, past, layout.head_dim), np.float32)
            for b, (slot, start) in enumerate(zip(slots, starts, strict=True)):
                tensor[b, :, :start] = slot.kv[j, :, :start]
            feed[name] = tensor
        outputs = self._run(feed)
        for j, name in enumerate(self._present_names):
            present = outputs[name]
            for b, (slot, start, length) in enumerate(zip(slots, starts, lengths, strict=True)):
                slot.kv[j, :, start : start + length] = present[b, :, past : past + length]
        for slot, length in zip(slots, lengths, strict=True):
            slot.length += length
        logits = outputs["logits"]
        return np.stack([logits[b, length - 1] for b, length in enumerate(lengths)])

    # -- results, on the loop ------------------------------------------------------------------

    def _emit(self, sequence: GenSequence, token: int, now: float) -> None:
        if sequence.finish_reason is not None:
            return
        stats = self.stats
        if sequence.last_token_at is None:
            stats.time_to_first_token_s.append(now - sequence.arrived)
        else:
            stats.inter_token_s.append(now - sequence.last_token_at)
        sequence.last_token_at = now
        stats.generated_tokens += 1
        if token in self.options.eos_token_ids:
            self._finish(sequence, "stop")
            return
        sequence.generated.append(token)
        detok = sequence.detokenizer
        text = detok.push(token) if detok is not None else ""
        if detok is not None and detok.stopped:
            self._finish(sequence, "stop", text=text, tokens=[token])
        elif len(sequence.generated) >= sequence.max_tokens:
            self._finish(sequence, "length", text=text, tokens=[token])
        else:
            sequence.events.put_nowait(Chunk([token], text))

    def _finish(
        self,
        sequence: GenSequence,
        reason: FinishReason,
        error: EngineError | None = None,
        text: str = "",
        tokens: list[int] | None = None,
    ) -> None:
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason = reason
        if sequence.slot is not None:
            self.cache.release(sequence.slot)
        with contextlib.suppress(ValueError):
            self.running.remove(sequence)
        if reason in ("stop", "length") and sequence.detokenizer is not None:
            text += sequence.detokenizer.flush()
        sequence.events.put_nowait(Chunk(tokens or [], text, reason, error))
        self._wake.set()
        self._idle.set()

    def _fail(self, sequences: list[GenSequence], error: EngineError) -> None:
        for sequence in sequences:
            self._finish(sequence, "error", error)
