"""What the generation front-ends share, whichever transport carried the request: who serves
generation for an engine (`generation_of`), and the check every generation request passes
before it runs (`caller`: authenticate, allow the model, refuse while draining).

HTTP's OpenAI routes (server/http/openai.py) and Triton generate extension
(server/http/triton_generate.py) and gRPC's decoupled ModelStreamInfer
(server/grpc/generate.py) call these; the rest of generation is engine/generation's."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Protocol

from engine.auth import Authenticator, Principal, authenticate_headers
from engine.datatypes import received
from engine.errors import InvalidInput, ShuttingDown
from engine.generation.service import Generation, GenerationService

Headers = Mapping[str, str]


class FrontEnd(Protocol):
    """What these routes use of the engine facade besides generation."""

    @property
    def authenticator(self) -> Authenticator: ...
    @property
    def draining(self) -> bool: ...


_services: weakref.WeakKeyDictionary[object, GenerationService] = weakref.WeakKeyDictionary()


def generation_of(engine: object) -> Generation | None:
    """Who serves generation for `engine`: a worker's RemoteEngine relays to the engine process
    (it is a Generation itself); the in-process engine gets one GenerationService over its
    registry and limiter; anything else has no generation (the routes are not mounted)."""
    if hasattr(engine, "generate") and hasattr(engine, "generative_models"):
        return engine
    if hasattr(engine, "registry") and hasattr(engine, "limiter"):
        service = _services.get(engine)
        if service is None:
            service = _services[engine] = GenerationService(engine)  # type: ignore[arg-type]
        return service
    return None


ABSENT = object()
"""What `body.get(key, ABSENT)` gives for a field the request left out: refused as missing,
where an explicit null is refused as null."""


def refused(param: str, allowed: str, value: object) -> InvalidInput:
    """InvalidInput for request field `param`, which must be `allowed`: "<param> must be
    <allowed>; got <value as sent>", or "<param> is required: <allowed>" when it was left out."""
    if value is ABSENT:
        return InvalidInput(f"{param} is required: {allowed}", param)
    return InvalidInput(f"{param} must be {allowed}; got {received(value)}", param)


def caller(engine: FrontEnd, who: Headers | Principal, name: object) -> str | None:
    """The tenant of a caller allowed to generate with model `name` (ABSENT when the request
    left it out): `who` is the request's headers, or the principal they were authenticated as
    already, where the model's name is in the body (authentication comes before the body is
    read, so a stranger's is never parsed); ShuttingDown while draining."""
    if not isinstance(who, Principal):
        who = authenticate_headers(engine.authenticator, who)
    if not isinstance(name, str) or not name:
        raise refused("model", "a model name (string)", name)
    who.check_model(name)
    if engine.draining:
        raise ShuttingDown()
    return who.tenant
