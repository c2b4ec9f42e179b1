"""Token streams faked at the seam the OpenAI routes read (a TokenStream's chunks, counts and
cancel), for the tests of server/http/openai_choices.py and openai_answer.py."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.generation.sequence import Chunk


class FakeStream:
    """A TokenStream yielding `texts` (one token each), the last with `finish`."""

    def __init__(self, texts: list[str], finish: str = "stop") -> None:
        self._chunks = [Chunk([i], t) for i, t in enumerate(texts)]
        self._chunks[-1].finish_reason = finish  # type: ignore[assignment]
        self.cancelled = False
        self.headers: dict[str, str] = {}
        self.prompt_tokens = 2
        self.completion_tokens = len(texts)
        self.finish_reason = finish

    async def chunks(self) -> Any:
        for chunk in self._chunks:
            await asyncio.sleep(0)  # the others' turn: their chunks interleave
            yield chunk

    def cancel(self) -> None:
        self.cancelled = True
