"""A fixed-arrival-rate (open-loop) load: requests leave on a schedule drawn in advance (Poisson
arrivals at `rate_rps`, from a seed, so two configs get the same schedule), whatever the server
answers, as independent clients arrive in production.

A closed loop (locust's users send their next request the moment one is answered) cannot compare
latency at equal throughput: its throughput is whatever the server gives it, and by Little's law
its users' mean latency is users / throughput whatever the server does, so a request shed for its
deadline is only resent at once. Here the offered rate is the same for every config, and latency
is counted from each request's scheduled time, so a generator that falls behind cannot hide the
server's queueing (coordinated omission); how far it fell behind is reported as `send_lag_p99_s`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from loadtests.payloads import binary_body, output_names, random_tensor, resolve_inputs

BODIES = 64
"""Distinct request bodies dealt in turn (the benchmark models do not cache results)."""
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024


class ResponseError(Exception):
    """The server's answer is not an HTTP/1.1 response this client can read."""


class ClosedBeforeAnswer(ResponseError):
    """The connection ended before a byte of the answer came back."""


class Connections:
    """Keep-alive HTTP/1.1 POSTs over raw asyncio streams, a connection per request in flight.
    httpx spends ~5 ms of CPU per request here, which on the generator's one core caps the
    offered rate near 200/s and delays the sends; this spends a small fraction of that."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"open-loop load needs an http:// URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        """POST `body` and read the whole answer; its status code. A kept-alive connection that
        the server closed while it sat idle (its keep-alive timeout) ends before any answer: the
        request is sent again, once, on a new connection, as HTTP clients do."""
        reused = bool(self._idle)
        try:
            return await self._post(path, body, headers, reuse=True)
        except (ClosedBeforeAnswer, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
        return await self._post(path, body, headers, reuse=False)

    async def _post(self, path: str, body: bytes, headers: dict[str, str], reuse: bool) -> int:
        if reuse and self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, limit=MAX_HEADER_BYTES
            )
            self._open.add(writer)
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            status, keep = await _read_response(reader)
        except BaseException:
            self._close(writer)
            raise
        if keep:
            self._idle.append((reader, writer))
        else:
            self._close(writer)
        return status

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def close(self) -> None:
        for writer in list(self._open):
            self._close(writer)
        self._idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, whether the connection stays open) of one response, its body read and dropped.
    The bytes are the server's: sizes are bounded and anything unexpected is a ResponseError."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ClosedBeforeAnswer("the connection closed before any answer") from exc
        raise ResponseError(f"no complete response head: {exc!r}") from exc
    except asyncio.LimitOverrunError as exc:
        raise ResponseError(f"no complete response head: {exc!r}") from exc
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if (
        len(status_line) < 2
        or not status_line[0].startswith("HTTP/1.")
        or not status_line[1].isdigit()
    ):
        raise ResponseError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "transfer-encoding" in fields or not fields.get("content-length", "").isdigit():
        raise ResponseError("response has no Content-Length (chunked answers are not read)")
    length = int(fields["content-length"])
    if length > MAX_BODY_BYTES:
        raise ResponseError(f"response body of {length} bytes; at most {MAX_BODY_BYTES} are read")
    try:
        await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ResponseError(f"response body cut short: {exc!r}") from exc
    return int(status_line[1]), fields.get("connection", "").lower() != "close"


@dataclass(frozen=True, slots=True)
class Answer:
    """One request scheduled after the warm-up."""

    status: str
    """The HTTP status, "error" for a transport error, "unanswered" when still open at the
    drain bound."""
    latency_s: float
    """From its scheduled send time to its answer (to the drain bound when unanswered)."""
    in_window: bool
    """Answered before the schedule ended (the span throughput is counted over)."""


@dataclass(frozen=True, slots=True)
class OpenLoopResult:
    """What one open-loop run measured, over the requests scheduled after its warm-up."""

    rate_rps: float
    seconds: float
    """The measured span of the schedule (the warm-up excluded)."""
    answers: list[Answer]
    send_lag_p99_s: float

    def summary(self, target_s: float) -> dict[str, Any]:
        """Rates over the span (200s answered within it: `ok_rps`; of those, within `target_s`
        of their send time: `goodput_rps`), latency quantiles in ms, and the shed (504) part."""
        ok = sorted(a.latency_s for a in self.answers if a.status == "200")
        answered = sorted(a.latency_s for a in self.answers if a.status not in NO_ANSWER)
        in_window = [a for a in self.answers if a.status == "200" and a.in_window]
        statuses = Counter(a.status for a in self.answers)
        sent = len(self.answers)
        return {
            "offered_rps": self.rate_rps,
            "sent": sent,
            "ok_rps": len(in_window) / self.seconds,
            "goodput_rps": sum(1 for a in in_window if a.latency_s <= target_s) / self.seconds,
            "ok_p50_ms": _quantile(ok, 0.50) * 1e3,
            "ok_p99_ms": _quantile(ok, 0.99) * 1e3,
            "all_p99_ms": _quantile(answered, 0.99) * 1e3,
            "shed_fraction": statuses.get("504", 0) / sent if sent else 0.0,
            "statuses": dict(statuses),
            "send_lag_p99_ms": self.send_lag_p99_s * 1e3,
        }


NO_ANSWER = ("error", "unanswered")


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def binary_bodies(metadata: dict[str, Any], count: int, seed: int) -> tuple[list[bytes], int]:
    """`count` random binary-extension requests for the model and their JSON header length."""
    rng = np.random.default_rng(seed)
    inputs = resolve_inputs(metadata)
    outputs = output_names(metadata)
    bodies = []
    header_length = 0
    for _ in range(count):
        body, header_length = binary_body(
            inputs, [random_tensor(spec, rng) for spec in inputs], outputs
        )
        bodies.append(body)
    return bodies, header_length


async def run_open_loop(
    url: str,
    model: str,
    rate_rps: float,
    seconds: float,
    warmup_s: float = 1.0,
    seed: int = 0,
    drain_s: float = 30.0,
) -> OpenLoopResult:
    """Send binary-extension infer requests to `model` at `rate_rps` (Poisson) for `warmup_s`
    plus `seconds`; wait up to `drain_s` for the last answers. Only requests scheduled after the
    warm-up count: the first ones teach a freshly loaded model's cost fit."""
    if rate_rps <= 0 or seconds <= 0:
        raise ValueError(f"rate_rps and seconds must be > 0, got {rate_rps} and {seconds}")
    rng = np.random.default_rng(seed)
    span = warmup_s + seconds
    gaps = rng.exponential(1.0 / rate_rps, size=int(rate_rps * span * 1.5) + 16)
    schedule = np.cumsum(gaps)
    schedule = schedule[schedule < span].tolist()
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        metadata = (await client.get(f"/v2/models/{model}")).raise_for_status().json()
    bodies, header_length = binary_bodies(metadata, BODIES, seed)
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(header_length),
    }
    path = f"/v2/models/{model}/infer"
    loop = asyncio.get_running_loop()
    connections = Connections(url)
    answers: dict[int, Answer] = {}
    lags: list[float] = []
    start = loop.time() + 0.05
    end = start + span

    async def one(index: int, body: bytes, due: float) -> None:
        try:
            status = str(await connections.post(path, body, headers))
        except (OSError, ResponseError):
            status = "error"
        answered = loop.time()
        answers[index] = Answer(status, answered - due, answered <= end)

    tasks: dict[int, asyncio.Task[None]] = {}
    try:
        for index, offset in enumerate(schedule):
            due = start + offset
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if offset >= warmup_s:
                lags.append(loop.time() - due)
            body = bodies[index % len(bodies)]
            tasks[index] = asyncio.create_task(one(index, body, due))
        if tasks:
            _done, pending = await asyncio.wait(tasks.values(), timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await connections.close()
    given_up = loop.time()
    counted = [
        answers.get(index) or Answer("unanswered", given_up - (start + offset), False)
        for index, offset in enumerate(schedule)
        if offset >= warmup_s
    ]
    lags.sort()
    return OpenLoopResult(rate_rps, seconds, counted, _quantile(lags, 0.99) if lags else 0.0)
