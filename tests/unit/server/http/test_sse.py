"""Server-sent events stay one line per event for line-based readers (httpx's `aiter_lines`
splits where `str.splitlines` does), whatever characters the text carries: at the encoder, and
through the OpenAI and Triton generate routes over a generation that produces them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
import orjson
import pytest
from fastapi import FastAPI

from engine.auth import Authenticator
from engine.generation.sequence import Chunk
from engine.generation.service import GenerateRequest
from engine.metrics import Metrics
from engine.settings import AuthSettings
from server.dataplane import DataPlane
from server.http import sse
from server.http.openai import openai_router
from server.http.triton_generate import generate_router
from server.settings import Settings

# Every character str.splitlines breaks at: the SSE line ends, and those JSON leaves raw.
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
TEXT = "".join(f"{i}{ch}" for i, ch in enumerate(BREAKS)) + "\r\nend"


def lines_read(body: bytes) -> list[str]:
    """The lines httpx's line reader gives for `body`."""
    return list(httpx.Response(200, content=body).iter_lines())


@pytest.mark.parametrize("ch", list(BREAKS))
def test_an_event_is_one_line_whatever_its_text(ch: str) -> None:
    data = {"text": f"a{ch}b", "nested": [f"{ch}"]}
    lines = lines_read(sse.event(data) + sse.event(data))
    assert [line for line in lines if line] == [lines[0], lines[0]]
    assert lines[0].startswith("data: ")
    assert orjson.loads(lines[0][len("data: ") :]) == data


def test_escaped_bytes_are_only_those_characters() -> None:
    # U+0085, U+2028 and U+2029 are escaped; a character whose UTF-8 shares their bytes is not.
    text = "\u0105\u2027\u202a\u2028é"  # ą (c4 85), ‧ (e2 80 a7), U+202A (e2 80 aa)
    payload = sse.dumps({"t": text})
    assert b"\\u2028" in payload
    assert "\u0105\u2027\u202a".encode() in payload
    assert orjson.loads(payload) == {"t": text}


class FakeStream:
    """A generation that answers TEXT in two chunks."""

    headers: ClassVar[dict[str, str]] = {}
    prompt_tokens = 3
    completion_tokens = 2
    finish_reason = "length"

    async def chunks(self) -> AsyncIterator[Chunk]:
        half = len(TEXT) // 2
        yield Chunk([1], TEXT[:half])
        yield Chunk([2], TEXT[half:], "length")

    def cancel(self) -> None:
        pass


class FakeGeneration:
    def generative_models(self) -> list[str]:
        return ["m"]

    async def generate(self, request: GenerateRequest) -> FakeStream:
        return FakeStream()


class FakeFrontEnd:
    authenticator = Authenticator(AuthSettings())
    draining = False
    generation = FakeGeneration()
    tracing = None
    metrics = Metrics(lambda: {"models": [], "index": [], "in_flight": 0})

    def label_for(self, name: str) -> str:
        return name


def app() -> FastAPI:
    app = FastAPI()
    plane = DataPlane(FakeFrontEnd(), Settings())  # type: ignore[arg-type]
    app.include_router(openai_router(plane))
    app.include_router(generate_router(plane))
    return app


async def streamed_events(path: str, body: dict[str, Any]) -> list[Any]:
    transport = httpx.ASGITransport(app=app())
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        client.stream("POST", path, json=body) as reply,
    ):
        assert reply.status_code == 200
        lines = [line async for line in reply.aiter_lines()]
    data = [line[len("data: ") :] for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line), lines
    return [orjson.loads(item) for item in data if item != "[DONE]"]


async def test_openai_stream_keeps_each_event_on_one_line() -> None:
    body = {"model": "m", "prompt": "p", "stream": True}
    chunks = await streamed_events("/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    body = {"model": "m", "messages": [{"role": "user", "content": "p"}], "stream": True}
    chunks = await streamed_events("/v1/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == TEXT


async def test_triton_generate_stream_keeps_each_event_on_one_line() -> None:
    events = await streamed_events("/v2/models/m/generate_stream", {"text_input": "p"})
    assert "".join(e["text_output"] for e in events) == TEXT
