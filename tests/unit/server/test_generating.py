"""A generation request in the data plane (server/generating.py) over FakeEngine and fake token
streams: started in order, a refusal cancelling the streams started, and counted once, when it is
refused or when its last stream ends, with the status its streams ended with."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.auth import digest_key
from engine.errors import InvalidInput, RateLimited
from engine.generation.sequence import Chunk
from engine.generation.service import GenerateRequest
from engine.settings import ApiKey, AuthSettings, TracingSettings
from engine.tracing import Tracing
from server.dataplane import DataPlane
from server.generating import GenerationCall, GenerationRoute
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine
from tests.unit.server.test_dataplane import counted

KEYS = [ApiKey(digest=digest_key("user"), tenant="acme")]
ROUTE = GenerationRoute("grpc", "test", "gRPC ModelStreamInfer echo", [("x-api-key", "user")])


class FakeStream:
    """A TokenStream yielding `texts`, the last chunk with `finish` (and `error`)."""

    def __init__(self, texts: list[str], error: Exception | None = None) -> None:
        self._chunks = [Chunk([i], t) for i, t in enumerate(texts)]
        self._chunks[-1].finish_reason = "stop" if error is None else "error"
        self._chunks[-1].error = error  # type: ignore[assignment]
        self.cancelled = False
        self.headers: dict[str, str] = {}
        self.prompt_tokens = 2
        self.completion_tokens = len(texts)
        self.finish_reason = self._chunks[-1].finish_reason

    async def chunks(self) -> Any:
        for chunk in self._chunks:
            await asyncio.sleep(0)
            yield chunk

    def cancel(self) -> None:
        self.cancelled = True


class FakeGeneration:
    """The engine's Generation: each request's stream from `streams`, refusing the one at
    `refuse_at`."""

    def __init__(self, streams: list[FakeStream], refuse_at: int | None = None) -> None:
        self.streams = streams
        self.refuse_at = refuse_at
        self.started: list[FakeStream] = []

    def generative_models(self) -> list[str]:
        return ["echo"]

    async def generate(self, request: GenerateRequest) -> FakeStream:
        if len(self.started) == self.refuse_at:
            raise RateLimited("tenant 'acme' is over its rate limit", 1.0)
        self.started.append(self.streams[len(self.started)])
        return self.started[-1]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(AuthSettings(keys=KEYS))


def serving(engine: FakeEngine, generation: FakeGeneration) -> GenerationCall:
    engine.generate = generation.generate  # type: ignore[attr-defined]  # a Generation now
    engine.generative_models = generation.generative_models  # type: ignore[attr-defined]
    return DataPlane(engine, Settings()).generation_call(ROUTE, "echo")  # type: ignore[arg-type]


def asked(n: int) -> list[GenerateRequest]:
    return [GenerateRequest("echo", "acme", f"prompt {k}") for k in range(n)]


async def test_a_refused_choice_cancels_the_ones_started_and_counts_its_refusal(
    engine: FakeEngine,
) -> None:
    generation = FakeGeneration([FakeStream(["a"]) for _ in range(4)], refuse_at=2)
    call = serving(engine, generation)
    with pytest.raises(RateLimited):
        await call.start(asked(4))
    assert [s.cancelled for s in generation.started] == [True, True]
    assert counted(engine) == {("echo", "", "grpc", "429"): 1.0}


async def test_a_request_is_counted_once_when_its_last_stream_ends(engine: FakeEngine) -> None:
    call = serving(engine, FakeGeneration([FakeStream(["a", "b"]), FakeStream(["x"])]))
    first, second = await call.start(asked(2))
    assert [c.text async for c in second.chunks()] == ["x"]
    assert counted(engine) == {}  # one stream is still open
    assert [c.text async for c in first.chunks()] == ["a", "b"]
    first.cancel()  # the route cancels every stream at its end: a no-op once it ended
    assert counted(engine) == {("echo", "", "grpc", "200"): 1.0}


async def test_a_stream_left_before_its_end_counts_the_client_gone(engine: FakeEngine) -> None:
    call = serving(engine, FakeGeneration([FakeStream(["a", "b", "c"])]))
    [stream] = await call.start(asked(1))
    chunks = stream.chunks()
    assert (await anext(chunks)).text == "a"
    stream.cancel()
    await chunks.aclose()
    assert counted(engine) == {("echo", "", "grpc", "499"): 1.0}


async def test_an_error_a_stream_ends_with_is_the_request_status(engine: FakeEngine) -> None:
    refused = FakeStream(["{"], InvalidInput("the grammar cannot be compiled"))
    call = serving(engine, FakeGeneration([FakeStream(["a", "b"]), refused]))
    first, second = await call.start(asked(2))
    assert (await anext(second.chunks())).error is not None  # read, not to its end
    for stream in (first, second):  # as refused_grammar does: the others are left
        stream.cancel()
    assert counted(engine) == {("echo", "", "grpc", "400"): 1.0}


async def test_a_refusal_while_the_route_reads_the_request_is_counted(
    engine: FakeEngine,
) -> None:
    call = serving(engine, FakeGeneration([]))
    with pytest.raises(InvalidInput), call.reading():
        raise InvalidInput("max_tokens must be positive")
    assert counted(engine) == {("echo", "", "grpc", "400"): 1.0}
    call.refused(InvalidInput("again"))  # never counted twice
    assert counted(engine) == {("echo", "", "grpc", "400"): 1.0}


async def test_a_generation_is_one_trace_its_start_a_child_of_its_root(engine: FakeEngine) -> None:
    exporter = InMemorySpanExporter()
    engine.tracing = Tracing(TracingSettings(), exporter)  # type: ignore[assignment]
    call = serving(engine, FakeGeneration([FakeStream(["a"]), FakeStream(["b"])]))
    for stream in await call.start(asked(2)):
        assert [c.text async for c in stream.chunks()] in (["a"], ["b"])
    start, root = exporter.get_finished_spans()
    assert (start.name, root.name) == ("start", "test")
    assert start.parent is not None
    assert start.parent.span_id == root.context.span_id
    assert (root.attributes["sluice.model"], root.attributes["sluice.status"]) == ("echo", 200)
