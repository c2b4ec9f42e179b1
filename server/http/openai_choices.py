"""Several choices in one OpenAI answer (`n` > 1, a list of prompts on /v1/completions): one
generation per choice, each admitted and queued as its own sequence, in choice order (prompt
by prompt, `n` each, as OpenAI indexes them). The Engine decodes them together in its batch;
it has no way to fork a sequence, so each choice computes its prompt again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from engine.errors import BackendError, EngineError
from engine.generation.sequence import Chunk
from engine.generation.service import TokenStream


class Peeked:
    """A stream whose first chunk may be read before the answer starts (a guided request's
    grammar is compiled as its sequence starts: one the engine refuses is a 400, not an error
    inside a 200 stream)."""

    def __init__(self, stream: TokenStream) -> None:
        self.stream = stream
        self._chunks = stream.chunks()
        self._first: Chunk | None = None

    async def peek(self) -> Chunk:
        if self._first is None:
            self._first = await anext(self._chunks)
        return self._first

    async def chunks(self) -> AsyncIterator[Chunk]:
        if self._first is not None:
            yield self._first
            if self._first.finish_reason is not None:
                return
        async for chunk in self._chunks:
            yield chunk

    def cancel(self) -> None:
        self.stream.cancel()


async def collect(request: Request, streams: list[Peeked]) -> list[list[Chunk]]:
    """Every chunk of every stream, for an answer in one response; a client that goes away
    first cancels them all (their slots are freed at the next step)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in streams:
            stream.cancel()

    async def whole(stream: Peeked) -> list[Chunk]:
        return [chunk async for chunk in stream.chunks()]

    watcher = asyncio.create_task(watch())
    try:
        return list(await asyncio.gather(*(whole(stream) for stream in streams)))
    finally:
        watcher.cancel()
        for stream in streams:
            stream.cancel()  # a no-op once finished


async def merged(streams: list[Peeked]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) as each stream yields them, until every stream has finished."""
    queue: asyncio.Queue[tuple[int, Chunk]] = asyncio.Queue()

    async def pump(index: int, stream: Peeked) -> None:
        try:
            async for chunk in stream.chunks():
                queue.put_nowait((index, chunk))
        except EngineError as exc:
            queue.put_nowait((index, Chunk([], "", "error", exc)))
        except Exception:  # a relay gone wrong: the answer ends with an error, not a hang
            queue.put_nowait((index, Chunk([], "", "error", BackendError("generation failed"))))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            index, chunk = await queue.get()
            if chunk.finish_reason is not None:
                left -= 1
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.cancel()


def seeded(options: dict[str, Any], choice: int) -> dict[str, Any]:
    """The options of choice `choice` of n: a seed given is the first choice's, seed + k the
    k-th's (the same seed for every choice would give n equal answers)."""
    seed = options.get("seed")
    if choice == 0 or not isinstance(seed, int) or isinstance(seed, bool):
        return options
    return options | {"seed": (seed + choice) % 2**63}
