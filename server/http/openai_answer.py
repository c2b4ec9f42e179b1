"""An OpenAI answer: its objects (completion, chat completion, their chunks, usage) and its
server-sent events (server/http/sse.py), choices and tool calls included."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.http import sse
from server.http.openai_choices import Peeked, merged
from server.http.openai_errors import error_object
from server.http.openai_tools import ToolPlan


class Completion:
    """One request's answer, as OpenAI objects (completion or chat completion)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def choice(
        self, index: int, text: str, finish: str | None, calls: list[Any] | None = None
    ) -> dict[str, Any]:
        """A choice of the whole answer; `calls` (OpenAI's tool_calls) stand for the text."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            return choice | {"message": message, "finish_reason": "tool_calls"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        return choice

    def whole(self, choices: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, choices) | {"usage": self.usage(tokens)}

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool = False,
        calls: list[Any] | None = None,
    ) -> dict[str, Any]:
        """A chunk of choice `index`: `text` None (a tool call's first chunk) has no content;
        `calls` is the whole call, in one delta, with its index as OpenAI streams it."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None and (text or first):
                delta["content"] = text
            if calls is not None:
                delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(calls)]
                choice["finish_reason"] = "tool_calls"
            choice["delta"] = delta
        else:
            choice |= {"text": text or "", "logprobs": None}
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, []) | {"usage": self.usage(completion_tokens)}

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


async def refused_grammar(streams: list[Peeked]) -> None:
    """Raise the error a stream begins with (a grammar the engine cannot compile), so that it
    is answered as a 400 before a 200 stream starts. Every stream is cancelled when it raises,
    or when the client's request is cancelled while it waits."""
    try:
        for stream in streams:
            first = await stream.peek()
            if first.error is not None:
                raise first.error
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise


async def stream_events(
    streams: list[Peeked], answer: Completion, include_usage: bool, plan: ToolPlan | None
) -> AsyncIterator[bytes]:
    """Server-sent events; when the client goes away Starlette cancels this generator and the
    sequences' slots are freed at the scheduler's next step. With `include_usage` (OpenAI's
    stream_options) every chunk carries `usage: null` and a last chunk with no choices carries
    the usage; without it the stream carries none. A choice that is, or may be, a tool call
    (tool_choice required, or auto once its text begins with `{`) is held back and sent whole
    at its end, as tool_calls (or as text when it is not a whole call)."""

    def event(body: dict[str, Any]) -> bytes:
        if include_usage:
            body["usage"] = None
        return sse.event(body)

    started: set[int] = set()
    decided: set[int] = set()
    held: dict[int, str] = {}  # the text of choices held back as tool calls
    try:
        async for index, chunk in merged(streams):
            if chunk.error is not None:
                yield sse.event(error_object(chunk.error, "server_error"))
                break
            first, text, finish = index not in started, chunk.text, chunk.finish_reason
            # Under auto the first text decides (a first token may bring none).
            undecided = plan is not None and index not in decided
            if undecided and (plan.mode == "required" or text or finish is not None):  # type: ignore[union-attr]
                decided.add(index)
                if plan.mode == "required" or text.startswith("{"):  # type: ignore[union-attr]
                    held[index] = ""
            if index in held:
                held[index] += text
                if first:
                    started.add(index)
                    yield event(answer.chunk(index, None, None, first=True))
                if finish is not None:
                    calls = plan.calls(held[index]) if plan is not None else None
                    rest = None if calls is not None else held[index]
                    yield event(answer.chunk(index, rest, finish, calls=calls))
            elif text or first or finish is not None:
                started.add(index)
                yield event(answer.chunk(index, text, finish, first))
        else:
            if include_usage:
                tokens = sum(s.stream.completion_tokens for s in streams)
                yield sse.event(answer.usage_chunk(tokens))
        yield sse.DONE
    finally:
        for stream in streams:
            stream.cancel()
