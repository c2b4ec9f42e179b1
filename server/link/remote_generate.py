"""The worker's side of a relayed generation (remote.py `RemoteEngine.generate`): a
`RemoteStream` is fed by the engine's STREAM, TOKENS and ERROR frames as they arrive, and an
ERROR frame becomes the engine's own error class again (`rebuild_error`, which every call the
worker relays uses). Split from remote.py, whose inference path it shares nothing with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine import errors
from engine.generation.sequence import Chunk
from server.link.frames import Kind

_ERRORS: dict[str, type[errors.EngineError]] = {
    name: value
    for name, value in vars(errors).items()
    if isinstance(value, type) and issubclass(value, errors.EngineError)
}


def rebuild_error(payload: dict[str, Any]) -> errors.EngineError:
    """The engine's error, of the same class, message, param and (a 429) what its limit counts,
    from an ERROR frame."""
    cls = _ERRORS.get(str(payload.get("error")), errors.BackendError)
    exc = cls.__new__(cls)
    message = str(payload.get("message", "internal error"))
    Exception.__init__(exc, message)
    exc.message = message
    retry = payload.get("retry_after_s")
    exc.retry_after_s = float(retry) if isinstance(retry, int | float) else None
    headers = payload.get("headers")
    exc.headers = {str(k): str(v) for k, v in headers.items()} if isinstance(headers, dict) else {}
    param = payload.get("param")
    exc.param = param if isinstance(param, str) else None
    if isinstance(exc, errors.RateLimited):
        exc.tokens = payload.get("tokens") is True
    return exc


class RemoteStream:
    """One generation relayed from the engine process (engine.generation.service.TokenStream):
    chunks are queued as their frames arrive and handed on one by one, so a stream is never
    buffered to its end."""

    def __init__(
        self,
        call_id: int,
        loop: asyncio.AbstractEventLoop,
        ended: Callable[[RemoteStream, bool], None],
    ) -> None:
        self.id = call_id
        self.started: asyncio.Future[None] = loop.create_future()
        self.headers: dict[str, str] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._ended_callback = ended  # the RemoteEngine forgets it (and tells the engine)
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._ended = False

    def on_frame(self, kind: Kind, message: dict[str, Any]) -> None:
        """A STREAM, TOKENS or ERROR frame for this stream, from the engine (untrusted: a
        malformed one raises ValueError, TypeError or KeyError, which ends the connection)."""
        if kind is Kind.STREAM:
            headers = message["headers"]
            if not isinstance(headers, dict):
                raise TypeError(f"STREAM headers must be an object; got {headers!r:.80}")
            self.admitted(
                {str(k): str(v) for k, v in headers.items()}, int(message["prompt_tokens"])
            )
        elif kind is Kind.TOKENS:
            finish = message["finish_reason"]
            chunk = Chunk(
                [int(t) for t in message["tokens"]],
                str(message["text"]),
                None if finish is None else str(finish),  # type: ignore[arg-type]
            )
            self.push(chunk, int(message["completion_tokens"]))
        else:  # ERROR: refused, or failed while running
            self.fail(rebuild_error(message))

    def admitted(self, headers: dict[str, str], prompt_tokens: int) -> None:
        self.headers, self.prompt_tokens = headers, prompt_tokens
        if not self.started.done():
            self.started.set_result(None)

    def push(self, chunk: Chunk, completion_tokens: int) -> None:
        self.completion_tokens = completion_tokens
        self._queue.put_nowait(chunk)
        if chunk.finish_reason is not None:
            self._end(tell_engine=False)

    def fail(self, error: errors.EngineError) -> None:
        """The engine refused it (before it started) or it failed, or the engine is gone."""
        if not self.started.done():
            self.started.set_exception(error)
        else:
            self._queue.put_nowait(Chunk([], "", "error", error))
        self._end(tell_engine=False)

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            while True:
                chunk = await self._queue.get()
                if chunk.finish_reason is not None:
                    self.finish_reason = chunk.finish_reason
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            self.cancel()

    def cancel(self) -> None:
        """The client left: the engine frees the sequence and sends nothing more for it, so a
        reader still iterating gets the last chunk here, "cancelled" as in one process."""
        if not self._ended:
            self._queue.put_nowait(Chunk([], "", "cancelled"))
        self._end(tell_engine=True)

    def _end(self, tell_engine: bool) -> None:
        if not self._ended:
            self._ended = True
            self._ended_callback(self, tell_engine)
