"""server/logs.py: JSON and text formatting, request ids on records and responses, and the
start line's settings with secrets masked."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from engine.settings import ApiKey, AuthSettings, CacheSettings, RateLimitSettings
from server.logs import (
    JsonFormatter,
    RequestIdFilter,
    RequestIdMiddleware,
    TextFormatter,
    choose_request_id,
    configure_logging,
    effective_settings,
    mask_url,
    request_id,
    resolve_format,
    start_summary,
)
from server.settings import Settings

DIGEST = "sha256:" + "ab12cd34" * 8


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A private logger writing to a string through the request id filter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("sluice.test-logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, stream, handler
    logger.handlers[:] = []


def test_json_lines_carry_extras_and_the_request_id(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, stream, handler = captured
    handler.setFormatter(JsonFormatter())
    token = request_id.set("rid-1")
    try:
        logger.info("loaded %s", "demo", extra={"provider": "CPUExecutionProvider", "load_s": 0.5})
    finally:
        request_id.reset(token)
    logger.warning("after the request")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "loaded demo"
    assert first["level"] == "info"
    assert first["logger"] == "sluice.test-logs"
    assert (first["provider"], first["load_s"], first["request_id"]) == (
        "CPUExecutionProvider",
        0.5,
        "rid-1",
    )
    assert first["time"].endswith("Z")
    assert "request_id" not in second


def test_text_lines_show_the_request_id_and_fields(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, stream, handler = captured
    handler.setFormatter(TextFormatter())
    token = request_id.set("rid-2")
    try:
        logger.debug("POST /x -> 200", extra={"status": 200, "settings": {"a": [1]}})
    finally:
        request_id.reset(token)
    line = stream.getvalue().strip()
    assert " DEBUG sluice.test-logs: POST /x -> 200 [rid-2]" in line
    assert line.endswith('status=200 settings={"a":[1]}')


def test_configure_logging_text_and_quiet_grpc(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("grpc").level)
    try:
        configure_logging("debug", "text")
        assert isinstance(root.handlers[0].formatter, TextFormatter)
        assert root.level == logging.DEBUG
        assert logging.getLogger("grpc").level == logging.INFO
        logging.getLogger("sluice.x").debug("hello", extra={"model": "demo"})
        assert capsys.readouterr().err.strip().endswith("sluice.x: hello model=demo")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("grpc").setLevel(saved[2])


@pytest.fixture
def terminal() -> Iterator[tuple[int, io.TextIOWrapper]]:
    """A pseudo-terminal: its reading end (fd) and a text stream on its terminal end."""
    reader, writer = os.openpty()
    stream = open(writer, "w", buffering=1)  # noqa: SIM115 (closed below)
    yield reader, stream
    stream.close()
    os.close(reader)


def _read(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 1.0)[0]:
        chunks.append(os.read(fd, 65536))
        if chunks[-1].endswith(b"\n"):
            break
    return b"".join(chunks).decode()


def test_auto_is_text_on_a_terminal_and_json_elsewhere(
    terminal: tuple[int, io.TextIOWrapper],
) -> None:
    _, tty = terminal
    assert resolve_format("auto", tty) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    with open(os.devnull, "w") as devnull:
        assert resolve_format("auto", devnull) == "json"
    assert resolve_format("json", tty) == "json"  # forced either way
    assert resolve_format("text", io.StringIO()) == "text"


def test_configure_logging_auto_writes_text_lines_to_a_terminal(
    terminal: tuple[int, io.TextIOWrapper],
) -> None:
    reader, tty = terminal
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("grpc").level)
    try:
        assert configure_logging("info", "auto", stream=tty) == "text"
        logging.getLogger("sluice.x").info("hello", extra={"model": "demo"})
        line = _read(reader).strip()
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \S+ INFO sluice\.x: hello model=demo", line), line
        piped = io.StringIO()
        assert configure_logging("info", "auto", stream=piped) == "json"
        logging.getLogger("sluice.x").info("hello")
        assert json.loads(piped.getvalue())["message"] == "hello"
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("grpc").setLevel(saved[2])


def test_the_start_summary_is_one_short_line(tmp_path: Path) -> None:
    assert start_summary(Settings()) == (
        "starting sluice: http://127.0.0.1:8000, gRPC on 127.0.0.1:8001; serving the built-in "
        "demo model (none mode); 1 worker; no API keys (every caller is admin); cache memory "
        "(all settings at --log-level debug)"
    )
    keyed = Settings(
        host="::",
        grpc_enabled=False,
        workers=4,
        model_repository=tmp_path,
        auth=AuthSettings(keys=[ApiKey(digest=DIGEST, tenant="acme")]),
    )
    assert start_summary(keyed) == (
        f"starting sluice: http://[::]:8000, gRPC off; serving {tmp_path} (none mode); 4 "
        "workers; 1 API key; cache memory (all settings at --log-level debug)"
    )
    assert len(json.dumps(effective_settings(keyed))) > 1000  # what a terminal showed before


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://app:hunter2@cache.internal/1", "rediss://app:***@cache.internal/1"),
        ("redis://hunter2@host:6379", "redis://***@host:6379"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@[::1]:6379", "redis://:***@[::1]:6379"),
        ("redis://:pw@host:notaport/0", "***"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_effective_settings_mask_secrets() -> None:
    settings = Settings(
        cache=CacheSettings(backend="memory", redis_url="redis://:hunter2@10.0.0.5:6379/0"),
        rate_limit=RateLimitSettings(redis_url="redis://limits:s3cret@10.0.0.6:6379/1"),
        auth=AuthSettings(keys=[ApiKey(digest=DIGEST, tenant="acme")]),
    )
    shown = effective_settings(settings)
    text = json.dumps(shown)
    assert "hunter2" not in text
    assert "s3cret" not in text
    assert DIGEST not in text
    assert shown["cache"]["redis_url"] == "redis://:***@10.0.0.5:6379/0"
    assert shown["rate_limit"]["redis_url"] == "redis://limits:***@10.0.0.6:6379/1"
    assert shown["auth"]["keys"][0] == {
        "digest": "sha256:ab12cd34…",
        "tenant": "acme",
        "role": "user",
        "models": None,
        "name": None,
        "expires_at": None,
    }
    # Everything else is the effective value, defaults included.
    assert shown["http_port"] == 8000
    assert shown["tracing"]["otlp_endpoint"] is None
    assert shown["metrics"] == {"enabled": True, "port": None, "require_key": None}


@pytest.mark.parametrize(
    ("given", "kept"),
    [("abc-123", True), ("x" * 128, True), ("x" * 129, False), ("has space", False), ("", False)],
)
def test_choose_request_id(given: str, kept: bool) -> None:
    chosen = choose_request_id(given)
    assert (chosen == given) is kept
    if not kept:
        assert re.fullmatch("[0-9a-f]{32}", chosen)
        assert chosen != choose_request_id(given)


def test_a_forked_process_chooses_other_request_ids() -> None:
    """Workers are forked from one supervisor: their fresh ids must not repeat each other's."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running pytest's teardown
        os.write(write, choose_request_id(None).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    assert status == 0
    assert re.fullmatch("[0-9a-f]{32}", child)
    assert child != choose_request_id(None)


async def test_middleware_returns_and_binds_the_id() -> None:
    seen: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(request_id.get())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=RequestIdMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        given = await client.get("/v2", headers={"x-request-id": "client-7"})
        generated = await client.get("/v2")
    assert given.headers["x-request-id"] == "client-7"
    assert len(generated.headers["x-request-id"]) == 32
    assert seen == ["client-7", generated.headers["x-request-id"]]
    assert request_id.get() is None
