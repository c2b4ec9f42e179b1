"""A generation request's state in the scheduler (engine/generation/scheduler.py): its prompt,
sampler, cache slot and generated tokens, and the chunks its stream yields until a finish
reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import EngineError
from engine.generation.kv_cache import Slot
from engine.generation.sampling import Sampler, SamplingParams
from engine.generation.text import Detokenizer

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
