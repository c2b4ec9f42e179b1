"""What both schedulers do on the event loop with each token a step gave a sequence, and when a
sequence ends: the statistics, end-of-text, stop strings, `max_tokens`, and the chunk its stream
reads. The hand-written scheduler (scheduler.py) and the onnxruntime-genai one
(genai_scheduler.py) differ only in what a finished sequence gives back: a key/value cache slot,
or the Engine's request (`_release`)."""

from __future__ import annotations

import asyncio
import time

from engine.errors import EngineError
from engine.generation.config import GenerativeOptions
from engine.generation.sequence import Chunk, FinishReason, GenSequence
from engine.generation.stats import GenerationStats


class TokenSink:
    """The base of a scheduler: `_emit` a token, `_finish` a sequence (see the module docstring).
    `_idle` is set whenever a sequence finishes (a drain waits on it)."""

    stats: GenerationStats
    options: GenerativeOptions
    _idle: asyncio.Event

    def _release(self, sequence: GenSequence) -> None:
        """Give back what `sequence` held, once, as it finishes."""
        raise NotImplementedError

    def _emit(self, sequence: GenSequence, token: int, now: float) -> None:
        if sequence.finish_reason is not None:
            return
        stats = self.stats
        if sequence.last_token_at is None:
            stats.first_token(now - sequence.arrived)
        else:
            stats.next_token(now - sequence.last_token_at)
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
        self.stats.e2e.observe(time.monotonic() - sequence.arrived)
        self._release(sequence)
        if reason in ("stop", "length") and sequence.detokenizer is not None:
            text += sequence.detokenizer.flush()
        sequence.events.put_nowait(Chunk(tokens or [], text, reason, error))
        self._idle.set()
