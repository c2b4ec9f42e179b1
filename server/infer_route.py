"""The inference endpoint as plain ASGI, in front of FastAPI.

`POST /v2/models/{name}[/versions/{v}]/infer` is the hot path: FastAPI's routing, dependency
and middleware layers cost more than the rest of a small model's request (measured with py-spy:
about 40% of server CPU at 64 concurrent clients on the benchmark MLP), so this middleware
answers it directly and hands every other request to the FastAPI app behind it."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.auth import authenticate_headers
from engine.errors import EngineError, InvalidInput, PayloadTooLarge, ShuttingDown
from engine.facade import EngineFacade
from engine.settings import Settings
from engine.types import InferRequest
from server import binary, codec, raw_tensors
from server.errors import error_headers, http_status
from server.logs import choose_request_id, request_id

log = logging.getLogger("sluice.http")

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
    """ASGI middleware serving the infer endpoint; everything else goes to `app`."""

    def __init__(self, app: ASGIApp, engine: EngineFacade, settings: Settings) -> None:
        self.app = app
        self.engine = engine
        self.limit = settings.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.engine.draining:
            send = _closing(send)
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
        elif scope["method"] == "POST":
            await self.handle(scope, receive, send, match["name"], match["version"])
        else:
            body = _error_body("Method Not Allowed")
            await send({"type": "http.response.start", "status": 405, "headers": [
                (b"content-type", b"application/json"), (b"allow", b"POST"),
                (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        started = time.monotonic()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        rid = choose_request_id(headers.get("x-request-id"))
        token = request_id.set(rid)
        tracing = self.engine.tracing
        span = None if tracing is None else tracing.begin(INFER_SPAN, "http", name, headers)
        status, served = 200, ""
        try:
            if len(headers) != len(scope["headers"]):  # a header came more than once
                _check_single(scope["headers"])
            body, extra, served = await self.infer(headers, receive, name, version)
        except EngineError as exc:
            status = http_status(exc)
            body, extra = _error_body(exc.message), error_headers(exc)
            if status == 500:
                log.error("inference failed: %s", exc.message, extra={"model": name})
        except ClientGone:
            status = 499  # nobody is left to answer: the request was withdrawn, not computed
            return
        except asyncio.CancelledError:
            status = 499  # cancelled by the server's shutdown: no answer was sent
            raise
        except Exception as exc:  # a bug: log the traceback, answer JSON
            log.error("unhandled error in inference", exc_info=exc)
            status = 500
            body, extra = _error_body("internal server error (see the server log)"), {}
        finally:
            elapsed = time.monotonic() - started
            label = self.engine.label_for(name)
            self.engine.metrics.request(label, served, "http", status, elapsed)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "POST %s -> %d in %.3f ms", scope["path"], status, elapsed * 1e3,
                    extra={"path": scope["path"], "status": status,
                           "duration_ms": round(elapsed * 1e3, 3)},
                )  # fmt: skip
            if span is not None and tracing is not None:
                tracing.end(span, status)
            request_id.reset(token)
        extra.setdefault("content-type", "application/json")
        response_headers = [
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", rid.encode()),
            *((k.lower().encode(), v.encode()) for k, v in extra.items()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})

    async def infer(
        self, headers: dict[str, str], receive: Receive, name: str, version: str | None
    ) -> tuple[bytes, dict[str, str], str]:
        """The encoded response, its headers, and the version that answered."""
        if self.engine.draining:  # refuse before reading and decoding the body
            raise ShuttingDown()
        tenant = authenticate_headers(self.engine.authenticator, headers, name).tenant
        check = self.engine.input_check(name, version)
        body = await self.read_body(headers, receive)
        if not body:
            raise InvalidInput("request body is empty; expected a JSON inference request")

        # The decompressed size decides where decoding runs: here, only a bounded prefix of a
        # compressed body is inflated; a body that holds more is inflated in a worker thread.
        encoding = headers.get("content-encoding")
        plain = binary.decompress(body, encoding, self.limit, raw_tensors.OFFLOAD_BYTES)

        def decode() -> tuple[InferRequest, binary.BinaryRequest]:
            full = binary.decompress(body, encoding, self.limit) if plain is None else plain
            split = binary.split_request(full, headers, lambda h: codec.check_header(h, check))
            return codec.decode_request(split.header, name, version, split.arrays), split

        size = raw_tensors.OFFLOAD_BYTES + 1 if plain is None else len(plain)
        request, split = await raw_tensors.off_loop(size, decode)
        request.tenant = tenant
        response = await _unless_disconnected(receive, self.engine.infer(request))
        size = sum(array.nbytes for array in response.outputs.values())
        encode_started = time.monotonic()
        content, extra = await raw_tensors.off_loop(
            size,
            binary.encode_response,
            response,
            split.binary_outputs(response.outputs),
            codec.json_data,
            headers.get("accept-encoding"),
        )
        encoded = time.monotonic()
        self.engine.metrics.encoded("http", encoded - encode_started)
        if self.engine.tracing is not None:
            self.engine.tracing.record("encode", encode_started, encoded)
        headers_out = {key.lower(): value for key, value in extra.items()}
        return content, headers_out, response.model_version

    async def read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body, or PayloadTooLarge as soon as it passes the limit."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            raise PayloadTooLarge(int(declared), self.limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise PayloadTooLarge(size, self.limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


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


async def _unless_disconnected(receive: Receive, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it (the batcher withdraws the
    request). One watcher task per request, cancelled as soon as the work is done."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        message: Message = await receive()
        while message["type"] != "http.disconnect":
            message = await receive()
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # our cancel, not a server shutdown's
            log.debug("client disconnected; request withdrawn")
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()
