"""The API key a request carries: read from HTTP headers or gRPC metadata, then authenticated.

Both transports read the key with `api_key_from_headers` (`Authorization: Bearer <key>` or
`x-api-key: <key>`) and turn it into a `Principal` with `authenticate_headers`, which hands the
extracted key to the engine's `Authenticator` (engine/auth.py: the key table and what a key may
do); the data plane (server/dataplane.py) is the one caller of the latter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from engine.auth import Authenticator, Principal
from engine.errors import InvalidInput, Unauthenticated


def authenticate_headers(
    authenticator: Authenticator,
    headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]],
    model: str | None = None,
) -> Principal:
    """The principal behind HTTP headers or gRPC metadata; Forbidden when it may not use `model`.
    Every front-end authenticates through this one function."""
    principal = authenticator.authenticate(api_key_from_headers(headers))
    if model is not None:
        principal.check_model(model)
    return principal


class UniqueHeaders(dict[str, str]):
    """HTTP headers whose names are lower-case and each sent once (an ASGI request's, when none
    repeats): `api_key_from_headers` looks up its two headers instead of reading every one."""


CREDENTIAL_HEADERS = ("x-api-key", "authorization")


def api_key_from_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]],
) -> str | None:
    """The API key in HTTP headers or gRPC metadata, or None when neither header is present.

    Accepts `Authorization: Bearer <key>` and `x-api-key: <key>` with any header-name case.
    `headers` may be a mapping (HTTP) or the (key, value) pairs of gRPC invocation metadata.
    Raises Unauthenticated for an Authorization header of another scheme (when no x-api-key is
    sent) and for two different keys in the two headers, and InvalidInput for either header sent
    twice, rather than guessing which one counts.
    """
    if type(headers) is UniqueHeaders:
        pairs: Iterable[tuple[str, str | bytes]] = [
            (name, headers[name]) for name in CREDENTIAL_HEADERS if name in headers
        ]
        if not pairs:
            return None
    else:
        pairs = headers.items() if isinstance(headers, Mapping) else headers
    bearer: str | None = None
    scheme: str | None = None
    x_api_key: str | None = None
    sent = dict.fromkeys(CREDENTIAL_HEADERS, 0)
    for name, raw in pairs:
        value = (raw.decode("latin-1") if isinstance(raw, bytes) else raw).strip()
        lowered = name.lower()
        if lowered in sent:
            sent[lowered] += 1
        if lowered == "x-api-key":
            x_api_key = value or None
        elif lowered == "authorization":
            found_scheme, _, credentials = value.partition(" ")
            if found_scheme.lower() == "bearer":
                bearer = credentials.strip() or None
            else:
                scheme = found_scheme
    for header, times in sent.items():
        if times > 1:  # which one counts would depend on the proxy and the client
            raise InvalidInput(f"header '{header}' is sent {times} times; send it once")
    if bearer is not None and x_api_key is not None and bearer != x_api_key:
        raise Unauthenticated(
            "two different API keys sent (Authorization: Bearer and x-api-key); send one"
        )
    if bearer is None and x_api_key is None and scheme:
        raise Unauthenticated(
            f"Authorization header uses scheme '{scheme}'; expected 'Bearer <key>' "
            "(or send the key as 'x-api-key: <key>')"
        )
    return bearer or x_api_key
