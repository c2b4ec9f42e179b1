"""The engine process's side of a relayed generation (host.py GENERATE frames): the
request is admitted and run by the same GenerationService the in-process routes call, and its
chunks go back as they come, STREAM once admitted, then one TOKENS frame per chunk; an ERROR
with the same id refuses it or ends it. Split from host.py, whose inference path it
shares nothing with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine import errors
from engine.generation.service import GenerateRequest, GenerationService
from engine.tracing import request_id
from server.link.frames import Kind, error_payload

log = logging.getLogger("sluice.host")


async def relay_generation(
    generation: GenerationService,
    send: Callable[[Kind, Any], None],
    call_id: int,
    request: GenerateRequest,
    rid: str | None,
) -> None:
    """Admit and run one generation, its chunks sent as they come; a CANCEL, or the worker
    going away, cancels this task and so the sequence (freed at the next step)."""
    request_id.set(rid)
    try:
        stream = await generation.generate(request)
    except errors.EngineError as exc:
        send(Kind.ERROR, error_payload(call_id, exc))
        return
    except Exception:
        log.exception("generation failed in the engine process")
        send(Kind.ERROR, error_payload(call_id, errors.BackendError("internal error")))
        return
    try:
        started = {"headers": stream.headers, "prompt_tokens": stream.prompt_tokens}
        send(Kind.STREAM, {"id": call_id, **started})
        async for chunk in stream.chunks():
            if chunk.error is not None:
                send(Kind.ERROR, error_payload(call_id, chunk.error))
                return
            send(
                Kind.TOKENS,
                {
                    "id": call_id,
                    "tokens": chunk.tokens,
                    "text": chunk.text,
                    "finish_reason": chunk.finish_reason,
                    "completion_tokens": stream.completion_tokens,
                },
            )
    finally:
        stream.cancel()
