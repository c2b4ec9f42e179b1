"""The inference endpoint as plain ASGI, in front of FastAPI.

`POST /v2/models/{name}[/versions/{v}]/infer` is the hot path: FastAPI's routing, dependency
and middleware layers cost more than the rest of a small model's request (measured with py-spy:
about 40% of server CPU at 64 concurrent clients on the benchmark MLP), so this middleware
answers it directly and hands every other request to the FastAPI app behind it."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import EngineError, InvalidInput, ShuttingDown
from engine.types import InferRequest, InferResponse
from engine.validate import InputCheck
from server import raw_tensors
from server.auth_headers import UniqueHeaders
from server.dataplane import ClientGone, DataPlane
from server.errors import error_headers, http_status
from server.http import binary, codec, json_header
from server.http.cycle import RESPOND, WHEN_GONE
from server.ledger import Headers
from server.logs import choose_request_id, request_id
from server.settings import Settings

log = logging.getLogger("sluice.http")
T = TypeVar("T")
WhenGone = Callable[[Callable[[], None] | None], None]

INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
INFER_SPAN = "POST /v2/models/{name}/infer"
# Headers that decide how a request is read or who sends it: sent twice, they are ambiguous.
SINGLE_HEADERS = (
    "x-api-key",
    "authorization",
    "content-encoding",
    "inference-header-content-length",
)


class InferRoute:
    """ASGI middleware serving the infer endpoint over the data plane; everything else goes to
    `app`."""

    def __init__(self, app: ASGIApp, plane: DataPlane, settings: Settings) -> None:
        self.app = app
        self.plane = plane
        self.limit = settings.max_request_bytes  # of an inflated body: the sent one is BodyLimit's

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.plane.draining:
            send = _closing(send)
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
        elif scope["method"] == "POST":
            await self.handle(scope, receive, send, match["name"], match["version"])
        else:
            body = _error_body("Method Not Allowed")
            sent = dict(scope["headers"]).get(b"x-request-id")
            rid = choose_request_id(sent.decode("latin-1") if sent is not None else None)
            await send(
                {
                    "type": "http.response.start",
                    "status": 405,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"allow", b"POST"),
                        (b"x-request-id", rid.encode()),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        call = HttpCall(scope, receive, name, version, self.limit)
        rid = choose_request_id(call.header("x-request-id"))
        token = request_id.set(rid)
        try:
            status = 200
            body, extra = await self.plane.infer(call)
        except EngineError as exc:
            status, body, extra = http_status(exc), _error_body(exc.message), error_headers(exc)
        except ClientGone:
            return  # nobody is left to answer
        except asyncio.CancelledError:
            if not self.plane.draining:
                raise
            # The drain's bound passed with this request unanswered (its body still arriving,
            # say): uvicorn cancels it. Answered 503, not uvicorn's plain-text 500.
            late = ShuttingDown("server shut down before this request was answered")
            status, body = http_status(late), _error_body(late.message)
            extra = {**error_headers(late), "connection": "close"}
        finally:
            request_id.reset(token)
        response_headers = [
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", rid.encode()),
            *((k.lower().encode(), v.encode()) for k, v in extra.items()),
        ]
        if "content-type" not in extra:  # encode's headers are lower-case; errors have none
            response_headers.append((b"content-type", b"application/json"))
        respond = None if self.plane.draining else scope.get("extensions", {}).get(RESPOND)
        if respond is not None and respond(status, response_headers, body):
            return
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})


class HttpCall:
    """One `POST .../infer` as the data plane sees it (server.dataplane.InferCall)."""

    protocol = "http"
    span_name = INFER_SPAN

    def __init__(
        self, scope: Scope, receive: Receive, name: str, version: str | None, limit: int
    ) -> None:
        raw = scope["headers"]
        mapped = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        self.model, self.version, self.access = name, version, f"POST {scope['path']}"
        self._raw, self._mapped = raw, mapped
        # A header sent twice is ambiguous: the pairs go to authentication, which refuses two
        # keys, and decode refuses the others (SINGLE_HEADERS).
        self.headers: Headers = (
            UniqueHeaders(mapped)
            if len(mapped) == len(raw)
            else [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
        )
        self._receive = receive
        self._when_gone: WhenGone | None = scope.get("extensions", {}).get(WHEN_GONE)
        self._limit = limit
        self._split: binary.BinaryRequest | None = None

    def header(self, name: str) -> str | None:
        """A request header by its lower-case name (the last one when sent twice)."""
        return self._mapped.get(name)

    async def decode(self, check: InputCheck) -> InferRequest:
        if len(self._mapped) != len(self._raw):
            _check_single(self._raw)
        body = await self.read_body()
        if not body:
            raise InvalidInput("request body is empty; expected a JSON inference request")
        headers, limit = self._mapped, self._limit
        parsed = _small_json(body, headers)
        if parsed is not None:
            simple = codec.simple_request(parsed, self.model, self.version, check)
            if simple is not None:
                self._split = binary.BinaryRequest(parsed, {}, False, {})
                return simple
        # The decompressed size decides where decoding runs: here, only a bounded prefix of a
        # compressed body is inflated; a body that holds more is inflated in a worker thread.
        encoding = headers.get("content-encoding")
        plain = binary.decompress(body, encoding, limit, raw_tensors.OFFLOAD_BYTES)

        def decode() -> tuple[InferRequest, binary.BinaryRequest]:
            full = binary.decompress(body, encoding, limit) if plain is None else plain
            checked: list[codec.TensorHeader] = []  # read once: by the check, for the decode
            split = binary.split_request(
                full, headers, lambda h: checked.extend(codec.check_header(h, check)), parsed
            )
            request = codec.decode_request(
                split.header, self.model, self.version, split.arrays, checked
            )
            return request, split

        size = raw_tensors.OFFLOAD_BYTES + 1 if plain is None else len(plain)
        request, self._split = await raw_tensors.off_loop(size, decode)
        return request

    def encode(self, response: InferResponse) -> tuple[bytes, dict[str, str]]:
        """The response body and its (lower-case) headers."""
        assert self._split is not None
        content, extra = binary.encode_response(
            response,
            self._split.binary_outputs(response.outputs),
            codec.json_data,
            self._mapped.get("accept-encoding"),
        )
        return content, {key.lower(): value for key, value in extra.items()}

    async def wait(self, answer: Awaitable[InferResponse]) -> InferResponse:
        return await _unless_gone(self._when_gone, answer)

    async def read_body(self) -> bytes:
        """The whole body; past `max_request_bytes` the receive of server.http.app.BodyLimit,
        in front of this route, raises PayloadTooLarge as soon as it is declared or arrives."""
        chunks = []
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _small_json(body: bytes, headers: Mapping[str, str]) -> dict[str, Any] | None:
    """A small body that is all JSON (no binary data, no Content-Encoding), parsed: the JSON
    object, or None (not such a body, not an object, not JSON: the general path says which)."""
    if (
        len(body) >= json_header.LAZY_BYTES
        or "content-encoding" in headers
        or binary.HEADER_LENGTH.lower() in headers
    ):
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if type(parsed) is dict else None


def _check_single(raw_headers: list[tuple[bytes, bytes]]) -> None:
    names = [key.decode("latin-1").lower() for key, _ in raw_headers]
    for name in SINGLE_HEADERS:
        if names.count(name) > 1:
            raise InvalidInput(f"header '{name}' is sent {names.count(name)} times; send it once")


def _closing(send: Send) -> Send:
    """While draining, every response asks the client to close its connection, so no client
    writes its next request on a keep-alive connection that the server is about to close."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
        await send(message)

    return send_closing


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


async def _unless_gone(when_gone: WhenGone | None, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (the batcher withdraws the
    request) and raise ClientGone. `when_gone` is the WHEN_GONE scope extension of sluice's HTTP
    protocol (server/http/cycle.py); without it (another ASGI server) nobody is watching."""
    if when_gone is None:
        return await work
    current = asyncio.current_task()
    assert current is not None
    gone = False

    def cancel() -> None:
        nonlocal gone
        gone = True
        current.cancel()

    when_gone(cancel)
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # our cancel, not a server shutdown's
            log.debug("client disconnected; request withdrawn")
            raise ClientGone from None
        raise
    finally:
        when_gone(None)
