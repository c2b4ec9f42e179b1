"""Logging setup: plain text on a terminal and JSON lines elsewhere (or either, forced), with
the request id on every record made while a request is handled, and the start line: the
effective settings (secrets masked) in JSON, a one-line summary in text.

Fields given as `extra=` (model, provider, status, duration_ms, ...) are JSON keys in JSON mode
and `key=value` pairs after the message in text mode."""

from __future__ import annotations

import logging
import os
import random
import re
import sys
import time
from typing import Any, Literal, TextIO
from urllib.parse import urlsplit, urlunsplit

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.tracing import request_id
from server.settings import Settings

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """`time level logger: message [request_id] key=value ...` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        rid = fields.pop("request_id", None)
        if rid is not None:
            line = f"{line} [{rid}]"
        for key, value in fields.items():
            text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
            line = f"{line} {key}={text}"
        return line


def resolve_format(fmt: str, stream: TextIO) -> Literal["json", "text"]:
    """`fmt` ("auto", "json" or "text") as used on `stream`: auto is text on a terminal (a
    person reads it) and JSON anywhere else (a collector parses it), as uvicorn colours its
    lines only on a terminal."""
    if fmt == "json":
        return "json"
    if fmt == "text":
        return "text"
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def configure_logging(
    level: str, fmt: str, stream: TextIO | None = None
) -> Literal["json", "text"]:
    """Send every logger's records to `stream` (stderr) in `fmt` ("auto", "json" or "text")
    from `level` up; returns the format chosen."""
    stream = sys.stderr if stream is None else stream
    chosen = resolve_format(fmt, stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # grpc's core logs a line per call at debug level, with no request id: keep it to info up.
    logging.getLogger("grpc").setLevel(max(root.level, logging.INFO))
    return chosen


# -- the start line ------------------------------------------------------------------------------

MASK = "***"
_SECRET_KEYS = re.compile(r"password|secret|token|credential", re.IGNORECASE)
DIGEST_SHOWN = len("sha256:") + 8
"""Characters of an API key digest left in the log: enough to tell keys apart, no more."""


def effective_settings(settings: Settings) -> dict[str, Any]:
    """The settings as the server uses them, for the start line: passwords in URLs, secret-named
    fields and all but a prefix of API key digests masked."""
    masked: dict[str, Any] = _mask(settings.model_dump(mode="json"))
    return masked


def start_summary(settings: Settings) -> str:
    """The start line for a person at a terminal (text logs): where it listens and what it
    serves, instead of the whole settings object (a 2 kB line), which debug level still logs."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    grpc = f"gRPC on {host}:{settings.grpc_port}" if settings.grpc_enabled else "gRPC off"
    scheme = "https" if settings.tls.enabled else "http"
    repository = settings.model_repository or "the built-in demo model"
    keys = len(settings.auth.keys)
    auth = f"{keys} API key{'' if keys == 1 else 's'}"
    if settings.auth.keys_file is not None:
        auth += f" and the keys in {settings.auth.keys_file}"
    elif not keys:
        auth = "no API keys (every caller is admin)"
    workers = settings.workers
    return (
        f"starting sluice: {scheme}://{host}:{settings.http_port}, {grpc}; serving "
        f"{repository} ({settings.model_control_mode} mode); {workers} worker"
        f"{'' if workers == 1 else 's'}; {auth}; cache {settings.cache.backend} "
        "(all settings at --log-level debug)"
    )


def _mask(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(item, key) for item in value]
    if not isinstance(value, str):
        return value
    if _SECRET_KEYS.search(key):
        return MASK
    if key == "digest":
        return value[:DIGEST_SHOWN] + "…"
    return mask_url(value) if "://" in value else value


def mask_url(url: str) -> str:
    """`url` with its password (and a lone user name, which Redis treats as one) masked."""
    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # unparseable: better unreadable than leaked
        return MASK
    user = f"{parts.username}:{MASK}" if parts.password is not None else MASK
    return urlunsplit(parts._replace(netloc=f"{user}@{host}{port}"))


# -- request ids ---------------------------------------------------------------------------------

_VALID_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_IDS = random.Random()  # the ids' own: what they tell of its state predicts no other draw
os.register_at_fork(after_in_child=_IDS.seed)  # a forked worker draws its own ids


def choose_request_id(given: str | None) -> str:
    """The client's id when it is sane (1-128 visible ASCII characters), else a fresh one: 32
    hex digits from a generator seeded once per process, not os.urandom's system call per
    request. An id names a request in the logs; it is not a secret."""
    return given if given and _VALID_ID.fullmatch(given) else f"{_IDS.getrandbits(128):032x}"


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every log record made while handling it."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = request_id.get()
        if current is not None and not hasattr(record, "request_id"):
            record.request_id = current
        return True


class RequestIdMiddleware:
    """ASGI middleware: accept or generate `x-request-id`, return it, and bind it for logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = choose_request_id(given.decode("latin-1") if given else None)
        token = request_id.set(rid)
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


__all__ = [
    "JsonFormatter",
    "RequestIdFilter",
    "RequestIdMiddleware",
    "TextFormatter",
    "choose_request_id",
    "configure_logging",
    "effective_settings",
    "mask_url",
    "request_id",
    "resolve_format",
    "start_summary",
]
