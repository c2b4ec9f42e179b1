"""server.link.host_generate: the engine process's side of a relayed generation. Admitted, it
sends STREAM and then a TOKENS frame per chunk; a refusal, a failure or a chunk's error is one
ERROR frame with the call's id; however it ends (a CANCEL included), the stream is cancelled.
(The worker's side: test_remote_generate.py; both together: tests/integration/
test_workers_generate.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine import errors
from engine.generation.sequence import Chunk
from engine.generation.service import GenerateRequest
from engine.tracing import request_id
from server.link.frames import Kind, error_payload
from server.link.host_generate import relay_generation

REQUEST = GenerateRequest("m", None, "hello")


class Stream:
    """A TokenStream of `chunks`, then (with `hold`) none until it is cancelled."""

    def __init__(self, chunks: list[Chunk], hold: bool = False) -> None:
        self._chunks, self._hold = chunks, hold
        self.headers = {"x-sluice-queue": "0"}
        self.prompt_tokens = 3
        self.completion_tokens = 0
        self.cancelled = 0
        self.sent_all = asyncio.Event()

    async def chunks(self) -> AsyncIterator[Chunk]:
        for chunk in self._chunks:
            self.completion_tokens += len(chunk.tokens)
            yield chunk
        self.sent_all.set()
        if self._hold:
            await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled += 1


class Generation:
    """A GenerationService that admits with `stream`, or raises `refusal`."""

    def __init__(self, stream: Stream | None = None, refusal: Exception | None = None) -> None:
        self.stream, self.refusal = stream, refusal
        self.seen: list[tuple[GenerateRequest, str | None]] = []

    async def generate(self, request: GenerateRequest) -> Stream:
        self.seen.append((request, request_id.get()))
        if self.refusal is not None:
            raise self.refusal
        assert self.stream is not None
        return self.stream


async def relay(generation: Generation, rid: str | None = "r-1") -> list[tuple[Kind, Any]]:
    sent: list[tuple[Kind, Any]] = []
    await relay_generation(generation, lambda k, p: sent.append((k, p)), 7, REQUEST, rid)  # type: ignore[arg-type]
    return sent


async def test_an_admitted_generation_sends_stream_then_a_tokens_frame_per_chunk() -> None:
    stream = Stream([Chunk([5, 6], "he"), Chunk([7], "llo", "stop")])
    generation = Generation(stream)
    sent = await relay(generation)
    assert sent == [
        (Kind.STREAM, {"id": 7, "headers": {"x-sluice-queue": "0"}, "prompt_tokens": 3}),
        (Kind.TOKENS, {"id": 7, "tokens": [5, 6], "text": "he", "finish_reason": None,
                       "completion_tokens": 2}),
        (Kind.TOKENS, {"id": 7, "tokens": [7], "text": "llo", "finish_reason": "stop",
                       "completion_tokens": 3}),
    ]  # fmt: skip
    assert generation.seen == [(REQUEST, "r-1")]  # run under the worker's request id
    assert stream.cancelled == 1


async def test_a_refusal_is_an_error_frame_with_the_calls_id() -> None:
    refusal = errors.RateLimited("t", 1.5)
    sent = await relay(Generation(refusal=refusal))
    assert sent == [(Kind.ERROR, error_payload(7, refusal))]
    assert sent[0][1]["error"] == "RateLimited"


async def test_an_unexpected_failure_is_an_internal_error_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, "sluice.host"):
        sent = await relay(Generation(refusal=RuntimeError("bug")))
    assert sent == [(Kind.ERROR, error_payload(7, errors.BackendError("internal error")))]
    assert "generation failed in the engine process" in caplog.text
    assert "bug" in caplog.text  # the traceback goes to the log, not to the worker


async def test_a_chunks_error_ends_the_relay_with_it() -> None:
    failure = errors.InvalidInput("the grammar cannot be compiled")
    stream = Stream([Chunk([1], "a"), Chunk([], "", "error", failure), Chunk([2], "b")])
    sent = await relay(Generation(stream))
    assert [kind for kind, _ in sent] == [Kind.STREAM, Kind.TOKENS, Kind.ERROR]
    assert sent[-1] == (Kind.ERROR, error_payload(7, failure))
    assert stream.cancelled == 1


async def test_a_cancel_mid_stream_cancels_the_stream() -> None:
    stream = Stream([Chunk([1], "a")], hold=True)
    sent: list[tuple[Kind, Any]] = []
    task = asyncio.create_task(
        relay_generation(Generation(stream), lambda k, p: sent.append((k, p)), 7, REQUEST, None)  # type: ignore[arg-type]
    )
    async with asyncio.timeout(5):
        await stream.sent_all.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [kind for kind, _ in sent] == [Kind.STREAM, Kind.TOKENS]
    assert stream.cancelled == 1
