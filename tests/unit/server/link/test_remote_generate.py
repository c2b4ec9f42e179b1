"""A worker's relay of generation (server/link/remote.py `generate`, server/link/remote_generate.py
`RemoteStream`) against a scripted engine at the transport seam: a unix socket that speaks
server/link/frames.py frames, so each test says exactly which frames the engine sends and when. The
real host end is covered end to end by tests/integration/test_workers_generate.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidInput,
    QuotaExceeded,
    RateLimited,
    ShuttingDown,
)
from engine.generation.service import GenerateRequest
from server.errors import http_status
from server.http.openai_errors import openai_code, openai_type
from server.link.frames import FrameBuffer, Kind, error_payload, frame
from server.link.remote import RemoteEngine
from server.link.shm.arena import Arena
from server.settings import load_settings
from tests.unit.server.link.rig import until

STATE = {"draining": False, "models": ["tiny"], "generative": ["tiny"]}


class ScriptedEngine:
    """Answers HELLO with WELCOME and records every other frame; `send` writes frames to the
    worker's connection."""

    def __init__(self) -> None:
        self.received: list[tuple[Kind, Any]] = []
        self.writer: asyncio.StreamWriter | None = None
        self.connections: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.append(writer)
        frames = FrameBuffer()
        while data := await reader.read(65536):
            for kind, message in frames.feed(data):
                if kind is Kind.HELLO:
                    self.writer = writer
                    writer.write(frame(Kind.WELCOME, {"held": [], "state": STATE}))
                else:
                    self.received.append((kind, message))

    async def close(self) -> None:
        for writer in self.connections:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def send(self, kind: Kind, payload: Any) -> None:
        assert self.writer is not None
        self.writer.write(frame(kind, payload))

    def sent_by_worker(self, kind: Kind) -> list[Any]:
        return [message for k, message in self.received if k is kind]


@pytest.fixture
async def wired(socket_dir: str) -> AsyncIterator[tuple[RemoteEngine, ScriptedEngine]]:
    engine = ScriptedEngine()
    path = f"{socket_dir}/engine.sock"
    server = await asyncio.start_unix_server(engine.handle, path)
    remote = RemoteEngine(load_settings(), path, 0, (Arena(1 << 16), Arena(1 << 16)))
    await remote.start()
    yield remote, engine
    await remote.close()
    await engine.close()
    server.close()
    await server.wait_closed()


def ask() -> GenerateRequest:
    return GenerateRequest("tiny", "acme", prompt="a", options={"max_tokens": 3})


async def started(remote: RemoteEngine, engine: ScriptedEngine) -> Any:
    """A stream the scripted engine admitted (STREAM sent for the GENERATE it received)."""
    task = asyncio.create_task(remote.generate(ask()))
    await until(lambda: bool(engine.sent_by_worker(Kind.GENERATE)))
    call_id = engine.sent_by_worker(Kind.GENERATE)[-1]["id"]
    engine.send(Kind.STREAM, {"id": call_id, "headers": {"X-RateLimit-Limit": "50"},
                              "prompt_tokens": 1})  # fmt: skip
    return await task, call_id


def tokens(call_id: int, text: str, count: int, finish: str | None = None) -> dict[str, Any]:
    return {"id": call_id, "tokens": [count], "text": text, "finish_reason": finish,
            "completion_tokens": count}  # fmt: skip


async def test_the_request_is_relayed_and_chunks_come_as_their_frames_do(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    remote, engine = wired
    assert remote.generative_models() == ["tiny"]
    stream, call_id = await started(remote, engine)
    assert engine.sent_by_worker(Kind.GENERATE)[0]["request"] == ask().to_wire()
    assert (stream.headers, stream.prompt_tokens) == ({"X-RateLimit-Limit": "50"}, 1)
    chunks = stream.chunks()
    engine.send(Kind.TOKENS, tokens(call_id, "one", 1))
    first = await asyncio.wait_for(anext(chunks), 5)  # before the engine sent the rest
    assert (first.text, first.finish_reason, stream.completion_tokens) == ("one", None, 1)
    engine.send(Kind.TOKENS, tokens(call_id, " two", 2, "length"))
    last = await asyncio.wait_for(anext(chunks), 5)
    assert (last.text, last.finish_reason, stream.finish_reason) == (" two", "length", "length")
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)
    assert engine.sent_by_worker(Kind.CANCEL) == []  # it ended: nothing to cancel


async def test_an_engine_error_before_the_stream_is_raised_as_the_same_error(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    remote, engine = wired
    task = asyncio.create_task(remote.generate(ask()))
    await until(lambda: bool(engine.sent_by_worker(Kind.GENERATE)))
    call_id = engine.sent_by_worker(Kind.GENERATE)[0]["id"]
    engine.send(Kind.ERROR, {"id": call_id, "error": "RateLimited", "message": "slow down",
                             "retry_after_s": 2.0, "headers": {"Retry-After": "2"}})  # fmt: skip
    with pytest.raises(RateLimited) as refused:
        await task
    assert (refused.value.message, refused.value.retry_after_s) == ("slow down", 2.0)
    assert engine.sent_by_worker(Kind.CANCEL) == []


@pytest.mark.parametrize(
    "refused_by_engine",
    [
        InvalidInput("top_p must be ...", "top_p"),  # the engine process checks sampling
        ContextLengthExceeded("the prompt has 70 tokens"),  # its scheduler
        RateLimited("over its rate limit of 1 tokens/s", 2.0, tokens=True),  # its limiter
        QuotaExceeded("used its daily quota", 60.0),
    ],
    ids=["param", "code", "tokens", "quota"],
)
async def test_an_error_keeps_its_openai_param_code_and_type(
    wired: tuple[RemoteEngine, ScriptedEngine], refused_by_engine: EngineError
) -> None:
    # OpenAI's error `param` and `code` (which clients test to tell context overflow) were lost
    # on the way back from the engine process; so was the `type` of a 429 of a token limit.
    remote, engine = wired
    task = asyncio.create_task(remote.generate(ask()))
    await until(lambda: bool(engine.sent_by_worker(Kind.GENERATE)))
    call_id = engine.sent_by_worker(Kind.GENERATE)[0]["id"]
    engine.send(Kind.ERROR, error_payload(call_id, refused_by_engine))
    with pytest.raises(EngineError) as refused:
        await task
    got, sent = refused.value, refused_by_engine
    assert type(got) is type(sent)
    assert (got.message, got.param, openai_code(got), openai_type(got, http_status(got))) == (
        sent.message,
        sent.param,
        openai_code(sent),
        openai_type(sent, http_status(sent)),
    )


async def test_leaving_early_cancels_and_late_frames_are_ignored(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    remote, engine = wired
    stream, call_id = await started(remote, engine)
    engine.send(Kind.TOKENS, tokens(call_id, "one", 1))
    chunks = stream.chunks()
    assert (await asyncio.wait_for(anext(chunks), 5)).text == "one"
    await chunks.aclose()  # the client left
    await until(lambda: engine.sent_by_worker(Kind.CANCEL) == [{"id": call_id}])
    engine.send(Kind.TOKENS, tokens(call_id, " two", 2))  # sent before the CANCEL arrived
    engine.send(Kind.STATE, {**STATE, "generative": ["tiny", "other"]})
    await until(lambda: remote.generative_models() == ["tiny", "other"])
    assert remote.live  # the late frame did not end the connection


async def test_a_stream_cancelled_while_read_ends_as_cancelled(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    """A non-streamed completion reads every chunk while a watcher cancels the stream when the
    client leaves. The engine then sends nothing more for it, so the reader waited for a chunk
    that never came: the handler never ended, and a SIGTERM waited drain_timeout_s for it. It
    ends as the in-process stream does, with a chunk whose finish reason is "cancelled"."""
    remote, engine = wired
    stream, call_id = await started(remote, engine)
    reader = asyncio.create_task(collect(stream))
    engine.send(Kind.TOKENS, tokens(call_id, "one", 1))
    await until(lambda: stream.completion_tokens == 1)
    stream.cancel()  # the client left
    chunks = await asyncio.wait_for(reader, 5)
    assert [(c.text, c.finish_reason) for c in chunks] == [("one", None), ("", "cancelled")]
    assert stream.finish_reason == "cancelled"
    await until(lambda: engine.sent_by_worker(Kind.CANCEL) == [{"id": call_id}])


async def collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream.chunks()]


async def test_a_generation_the_plane_let_in_is_relayed_while_the_worker_drains(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    """Draining is the data plane's to refuse, as for inference: the relay sends a request
    the plane let in."""
    remote, engine = wired
    remote.stop_accepting()
    assert remote.draining
    stream, call_id = await started(remote, engine)
    assert [m["id"] for m in engine.sent_by_worker(Kind.GENERATE)] == [call_id]
    stream.cancel()


async def test_a_malformed_frame_or_a_lost_engine_ends_the_stream_with_an_error(
    wired: tuple[RemoteEngine, ScriptedEngine],
) -> None:
    remote, engine = wired
    stream, call_id = await started(remote, engine)
    chunks = stream.chunks()
    engine.send(Kind.TOKENS, {**tokens(call_id, "x", 1), "tokens": ["not a token"]})
    chunk = await asyncio.wait_for(anext(chunks), 5)  # an answer, never a hang
    assert chunk.finish_reason == "error"
    assert isinstance(chunk.error, ShuttingDown)
    assert "the engine process is gone" in chunk.error.message
    assert not remote.live
    with pytest.raises(ShuttingDown):
        await remote.generate(ask())
