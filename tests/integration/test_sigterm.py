"""No request is lost on SIGTERM: 32 clients keep a real `sluice serve` busy, the process gets
SIGTERM mid-load, and every request that was written gets an answer (200, or 503 / UNAVAILABLE
with Retry-After) until connections are refused. Three runs per protocol (each a fresh signal
timing; test_workers_sigterm.py runs the same load three times more per protocol through the
worker processes' front-ends), their servers started together before the first run.

"Lost" is a request fully written on a connection that then closed or reset with no answer. A
refused connect (the listener is closed) is not lost: the client never sent anything and retries.
HTTP clients mix a shared keep-alive pool with fresh connections per request; gRPC calls share a
few channels, as real clients do, and honour the Retry-After of an UNAVAILABLE answer (grpc
cancels calls that arrive after its stop begins, so the server stops once calls stop coming)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.integration.helpers_e2e import start_all, stop_all
from tests.servers import ServerProcess

RUNS = 3
CLIENTS = 32
FRESH = 8  # of the HTTP clients, how many open a new connection per request
WARM_ANSWERS = 150  # answered requests before the signal: every client is mid-loop
EXIT_BOUND_S = 15.0
DEMO_INPUT = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)


@dataclass
class Tally:
    """What one run's requests got."""

    answers: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    no_retry_after: int = 0

    @property
    def answered(self) -> int:
        return sum(self.answers.values())


@contextlib.contextmanager
def started(
    tmp_path: Path, runs: int, *args: str, grpc_enabled: bool
) -> Iterator[list[ServerProcess]]:
    """One server per run, all started at once before the first run: their start-up (mostly
    imports) overlaps on the cores instead of adding up, and an idle server waiting for its run
    changes nothing in the runs before it. Every one is stopped at the end."""
    # A short drain bound: the demo model drains in milliseconds, and a stuck drain fails fast.
    servers = [
        ServerProcess(
            "--drain-timeout-s",
            "5",
            *args,
            log_path=tmp_path / f"server{run}.log",
            grpc=grpc_enabled,
        )
        for run in range(runs)
    ]
    start_all(servers)
    try:
        yield servers
    finally:
        stop_all(servers)


async def signal_mid_load(
    server: ServerProcess, tally: Tally, clients: list[asyncio.Task[None]]
) -> None:
    """SIGTERM once the load is steady; return when the process has exited (code 0)."""
    deadline = time.monotonic() + 30
    while tally.answered < WARM_ANSWERS:
        assert time.monotonic() < deadline, f"load never got going: {tally}"
        assert not any(c.done() for c in clients), [c.exception() for c in clients if c.done()]
        await asyncio.sleep(0.01)  # polling a condition, bounded above
    server.terminate()
    code = await asyncio.to_thread(server.wait, EXIT_BOUND_S)
    assert code == 0, server.logs()


async def http_run(server: ServerProcess) -> Tally:
    tally = Tally()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                        "data": DEMO_INPUT.ravel().tolist()}]}  # fmt: skip
    url = f"{server.url}/v2/models/demo/infer"

    async def client_loop(client: httpx.AsyncClient) -> None:
        while True:
            try:
                response = await client.post(url, json=body)
            except httpx.ConnectError:
                return  # the listener is closed: nothing was sent
            except httpx.TransportError as exc:
                tally.lost.append(repr(exc))
                continue
            tally.answers[str(response.status_code)] += 1
            if response.status_code != 200 and "retry-after" not in response.headers:
                tally.no_retry_after += 1

    pooled = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=CLIENTS))
    fresh = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))
    async with pooled, fresh:
        clients = [
            asyncio.create_task(client_loop(fresh if index < FRESH else pooled))
            for index in range(CLIENTS)
        ]
        try:
            await signal_mid_load(server, tally, clients)
            async with asyncio.timeout(15):
                await asyncio.gather(*clients)
        finally:
            for task in clients:
                task.cancel()
    return tally


async def grpc_run(server: ServerProcess) -> Tally:
    tally = Tally()
    request = pb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(DEMO_INPUT.tobytes())
    exited = asyncio.Event()

    async def client_loop(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        while True:
            try:
                await stub.ModelInfer(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                metadata = dict(exc.trailing_metadata() or ())
                if exc.code() == grpc.StatusCode.UNAVAILABLE and "retry-after" in metadata:
                    tally.answers["UNAVAILABLE"] += 1  # the server's answer while draining
                    # As it asks, unless the process exits first: then the next call's refusal
                    # ends the loop, as it would after the whole wait.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(exited.wait(), float(metadata["retry-after"]))
                elif exc.code() == grpc.StatusCode.UNAVAILABLE and exited.is_set():
                    return  # the process is gone: connects fail
                elif exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in exc.details():
                    tally.answers["refused"] += 1  # the listener is closed: nothing was sent
                    await asyncio.sleep(0.05)  # a client's reconnect backoff
                else:
                    tally.lost.append(f"{exc.code().name}: {exc.details()}")
            else:
                tally.answers["OK"] += 1

    channels = [grpc.aio.insecure_channel(server.grpc_url) for _ in range(4)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    clients = [asyncio.create_task(client_loop(stubs[i % 4])) for i in range(CLIENTS)]
    try:
        await signal_mid_load(server, tally, clients)
        exited.set()
        async with asyncio.timeout(15):
            await asyncio.gather(*clients)
    finally:
        for task in clients:
            task.cancel()
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()
    return tally


@pytest.mark.parametrize(
    ("protocol", "run_load"), [("http", http_run), ("grpc", grpc_run)], ids=["http", "grpc"]
)
async def test_sigterm_under_load_loses_no_request(
    tmp_path: Path, protocol: str, run_load: Callable[[ServerProcess], object]
) -> None:
    with started(tmp_path, RUNS, grpc_enabled=protocol == "grpc") as servers:
        tallies = [await run_load(server) for server in servers]  # type: ignore[misc]
    summary = [(t.answers, len(t.lost), t.lost[:3]) for t in tallies]
    assert [len(t.lost) for t in tallies] == [0] * RUNS, summary
    assert [t.no_retry_after for t in tallies] == [0] * RUNS, summary
    # Every run really was mid-load at the signal: requests were answered during the drain too.
    ok = "200" if protocol == "http" else "OK"
    assert all(t.answers[ok] >= WARM_ANSWERS for t in tallies), summary


async def test_a_large_request_written_during_the_drain_gets_its_503(tmp_path: Path) -> None:
    """The server answers a request during the drain before reading its body (503 at the door,
    Connection: close). Closing the connection with the body still arriving would make the kernel
    reset it, and a reset can destroy the answer before the client reads it; the server reads
    the rest of the body first."""
    server = ServerProcess("--drain-timeout-s", "5", log_path=tmp_path / "server.log", grpc=False)
    server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: sluice\r\n\r\n")
        await reader.readuntil(b'{"live":true}')
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as probe:
            assert (await probe.get("/v2/health/ready")).status_code == 200  # kept alive
            server.terminate()
            deadline = time.monotonic() + 5
            while (await probe.get("/v2/health/ready")).status_code == 200:
                assert time.monotonic() < deadline, "readiness never turned 503"
                await asyncio.sleep(0.01)  # polling a condition, bounded above
        body = b"0" * (8 << 20)
        writer.write(
            b"POST /v2/models/demo/infer HTTP/1.1\r\nhost: sluice\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        writer.write(body)
        sending = asyncio.create_task(writer.drain())
        answer = await asyncio.wait_for(reader.read(), 10)
        with contextlib.suppress(ConnectionError):
            await sending
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"connection: close" in answer.lower()
        assert b"retry-after: 1" in answer.lower()
    finally:
        server.stop()
