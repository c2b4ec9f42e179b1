"""The gRPC front-end against a real `sluice serve` process, driven by raw grpc.aio clients:
stream backpressure, unauthenticated streams and the RPCs sluice does not implement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.integration.helpers_e2e import Key, write_settings
from tests.models import identity_model, write_model
from tests.servers import ServerProcess

MiB = 1 << 20
COLUMNS = 4096
"""Columns of the `wide` identity model: 16 KiB per request and per answer, so the bytes that
HTTP/2 flow-control windows hold are a few answers, not thousands."""
MAX_PENDING = 8
"""The stream bound the backpressure test configures (SLUICE_GRPC_STREAM_MAX_PENDING)."""


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the `wide` identity model and a small per-stream bound."""
    repo = tmp_path_factory.mktemp("repository")
    write_model(repo, "wide", identity_model("FP32", ("batch", COLUMNS)), "max_batch_size: 8\n")
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = {"SLUICE_GRPC_STREAM_MAX_PENDING": str(MAX_PENDING)}
    server = ServerProcess("--model-repository", str(repo), env=env, log_path=log).start()
    yield server
    server.stop()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _success_count(url: str, model: str) -> int:
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=5).json()
    count: int = stats["model_stats"][0]["inference_stats"]["success"]["count"]
    return count


def _wide_request(index: int) -> Any:
    request = pb.ModelInferRequest(model_name="wide", id=str(index))
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, COLUMNS])
    request.raw_input_contents.append(_wide_values(index).tobytes())
    return request


def _wide_values(index: int) -> np.ndarray:
    return np.arange(COLUMNS, dtype=np.float32).reshape(1, COLUMNS) + index


async def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_stream_stops_reading_while_answers_are_unread(wide_server: ServerProcess) -> None:
    """A client that writes but does not read: the server takes at most about `max pending`
    requests from the stream and its memory stays flat; once the client reads, every request
    gets its one answer."""
    total = 1500  # 23 MiB of requests; without backpressure the server takes them all at once
    url, pid = wide_server.url, wide_server.process.pid  # type: ignore[union-attr]
    before_count = _success_count(url, "wide")
    before_rss = _rss_bytes(pid)
    # No BDP probing: the client's receive window stays 64 KiB instead of growing to megabytes,
    # so what the client's transport buffers (answers the server sent) is a few answers.
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(wide_server.grpc_url, options=options) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        written = 0

        async def writer() -> None:
            nonlocal written
            for index in range(total):
                await call.write(_wide_request(index))
                written += 1
            await call.done_writing()

        writing = asyncio.create_task(writer())
        try:
            taken = lambda: _success_count(url, "wide") - before_count  # noqa: E731
            await _poll(lambda: taken() >= MAX_PENDING, 30, f"{MAX_PENDING} answers")
            # Watch for 2 s: the server must not take more while nothing is read. The client's
            # 64 KiB window holds 4 answers the server could send, hence the slack.
            peak, watch_until = 0, time.monotonic() + 2.0
            while time.monotonic() < watch_until:
                peak = max(peak, taken())
                await asyncio.sleep(0.1)
            grown = _rss_bytes(pid) - before_rss
            assert peak <= MAX_PENDING + 16, f"server took {peak} requests of an unread stream"
            assert not writing.done(), f"the client wrote all {written} requests unhindered"
            assert written < total // 2
            assert grown < 16 * MiB, f"server RSS grew {grown / MiB:.1f} MiB"

            answers: list[Any] = []

            async def reader() -> None:
                while (answer := await call.read()) is not grpc.aio.EOF:
                    answers.append(answer)

            await asyncio.wait_for(asyncio.gather(writing, reader()), 120)
        finally:
            writing.cancel()
    assert await call.code() == grpc.StatusCode.OK
    assert len(answers) == total
    assert [a.error_message for a in answers if a.error_message] == []
    ids = [int(a.infer_response.id) for a in answers]
    assert sorted(ids) == list(range(total))  # exactly one answer per request
    for answer in answers:
        response = answer.infer_response
        values = np.frombuffer(response.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(values, _wide_values(int(response.id)).reshape(-1))


# -- authentication of streams -------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Key]]:
    """The demo model behind one API key."""
    folder = tmp_path_factory.mktemp("keyed")
    key = Key.create("acme")
    config = write_settings(folder / "server.yaml", {"auth": {"keys": [key.entry()]}})
    server = ServerProcess("--config", str(config), log_path=folder / "server.log").start()
    yield server, key
    server.stop()


def _demo_request(index: int) -> Any:
    request = pb.ModelInferRequest(model_name="demo", id=str(index))
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.full((1, 16), index, np.float32).tobytes())
    return request


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key"),
        ((("x-api-key", "sk-not-a-configured-key"),), "unknown API key"),
        ((("authorization", "Bearer sk-not-a-configured-key"),), "unknown API key"),
    ],
)
async def test_stream_without_a_valid_key_is_unauthenticated_every_time(
    keyed_server: tuple[ServerProcess, Key], metadata: tuple[tuple[str, str], ...], message: str
) -> None:
    server, key = keyed_server
    seen: list[tuple[str, str]] = []
    async with grpc.aio.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for attempt in range(30):

            async def requests(attempt: int = attempt) -> AsyncIterator[Any]:
                for index in range(attempt % 10):  # also 0: a stream that sends nothing
                    yield _demo_request(index)

            call = stub.ModelStreamInfer(requests(), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            seen.append((info.value.code().name, info.value.details() or ""))
        # The same stream with the key works (the rejections above are not a broken server).
        keyed = stub.ModelStreamInfer(
            _requests_of(_demo_request(1), _demo_request(2)), metadata=(("x-api-key", key.key),)
        )
        answers = [answer async for answer in keyed]
    assert [code for code, _ in seen] == ["UNAUTHENTICATED"] * 30, seen
    assert all(message in details for _, details in seen), seen
    assert sorted(a.infer_response.id for a in answers) == ["1", "2"]


async def _requests_of(*requests: Any) -> AsyncIterator[Any]:
    for request in requests:
        yield request


# -- RPCs sluice does not implement ---------------------------------------------------------------


async def test_unimplemented_rpc_answers_unimplemented_and_logs_once(start_server: Any) -> None:
    server: ServerProcess = start_server()
    async with grpc.aio.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        codes = []
        for _ in range(50):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.TraceSetting(pb.TraceSettingRequest())
            codes.append(info.value.code())
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live  # the server is fine
    assert codes == [grpc.StatusCode.UNIMPLEMENTED] * 50
    assert server.stop() == 0
    log = _read(server.log_path)
    assert "Traceback" not in log
    assert "NotImplementedError" not in log
    lines = [line for line in log.splitlines() if "TraceSetting" in line]
    assert len(lines) == 1, lines
    assert "sluice does not implement TraceSetting" in (info.value.details() or "")


def _read(path: Path | None) -> str:
    assert path is not None
    return path.read_text()
