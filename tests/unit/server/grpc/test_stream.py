"""ModelStreamInfer (server/grpc/stream.py) over a real grpc.aio server on a free port backed by
FakeEngine: each request answered, cancellation, the stream's bound, a failed generation, and
streams refused for want of a key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import numpy as np
import pytest

from engine.auth import digest_key
from engine.errors import BackendError, RateLimited
from engine.generation.sequence import Chunk
from engine.settings import ApiKey, AuthSettings
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine
from tests.unit.server.grpc.serving import Stub, _serve, _status, output, raw_request


async def test_stream_infer_answers_each_request(stub: Stub) -> None:
    good = raw_request("double", {"x": ("FP32", np.ones((1, 4), np.float32))}, id="good")
    bad = raw_request("double", {"x": ("FP32", np.ones((1, 4), np.float32))}, id="bad")
    bad.raw_input_contents[0] = b"\0"

    async def requests() -> AsyncIterator[Any]:
        for request in (good, bad, good):
            yield request

    answers = [answer async for answer in stub.ModelStreamInfer(requests())]
    by_id = sorted((a.infer_response.id, a.error_message) for a in answers)
    assert by_id[0][0] == "bad"
    assert "received 1 bytes" in by_id[0][1]
    assert [a for a in by_id if a[0] == "good"] == [("good", ""), ("good", "")]


async def test_stream_cancellation_reaches_the_engine(stub: Stub, engine: FakeEngine) -> None:
    slow = raw_request("slow", {"x": ("FP32", np.zeros((1, 4), np.float32))}, id="s")
    hold = asyncio.Event()

    async def requests() -> AsyncIterator[Any]:
        yield slow
        await hold.wait()  # keep the stream open

    call = stub.ModelStreamInfer(requests())
    await asyncio.wait_for(engine.started.wait(), 10)
    call.cancel()
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert engine.cancelled.is_set()
    hold.set()


def _double(index: int, rows: int = 1) -> Any:
    x = np.full((rows, 4), index, np.float32)
    return raw_request("double", {"x": ("FP32", x)}, id=str(index))


async def _poll(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not met in {timeout_s} s"
        await asyncio.sleep(0.01)


async def test_stream_is_not_read_past_its_bound(engine: FakeEngine) -> None:
    """With nothing read by the client, the engine sees at most the bound plus the few answers
    the client's flow-control window absorbs; reading then lets every request through."""
    server, port = await _serve(engine, grpc_stream_max_pending=4)
    total, rows = 200, 1024  # 20 KiB answers: a 64 KiB window holds 3
    try:
        options = [("grpc.http2.bdp_probe", 0)]  # the client's window stays 64 KiB
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            written = 0

            async def writer() -> None:
                nonlocal written
                for index in range(total):
                    await call.write(_double(index, rows))
                    written += 1
                await call.done_writing()

            writing = asyncio.create_task(writer())
            await _poll(lambda: len(engine.requests) >= 4)
            peak, watch_until = 0, time.monotonic() + 1.0
            while time.monotonic() < watch_until:  # nothing read: the count must stay put
                peak = max(peak, len(engine.requests))
                await asyncio.sleep(0.05)
            answers = [answer async for answer in call]
            await asyncio.wait_for(writing, 10)
    finally:
        await server.stop(grace=None)
    assert peak <= 4 + 8, f"the engine got {peak} requests of an unread stream"
    assert written == total
    assert sorted(int(a.infer_response.id) for a in answers) == list(range(total))
    for answer in answers:
        expected = np.full((rows, 4), 2 * int(answer.infer_response.id), np.float32)
        np.testing.assert_array_equal(output(answer.infer_response, "y"), expected)


def test_stream_bound_setting() -> None:
    assert Settings().grpc_stream_max_pending == 64
    for bad in (0, 65537):
        with pytest.raises(ValueError, match="grpc_stream_max_pending"):
            Settings(grpc_stream_max_pending=bad)


async def test_stream_runs_at_most_its_bound_at_once(engine: FakeEngine) -> None:
    """Requests held by the engine count against the bound: no flow-control slack here."""
    server, port = await _serve(engine, grpc_stream_max_pending=4)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            slow = [
                raw_request("slow", {"x": ("FP32", np.full((1, 4), i, np.float32))}, id=str(i))
                for i in range(20)
            ]
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(_requests(slow))
            answers: list[Any] = []
            reading = asyncio.create_task(_collect(call, answers))
            await _poll(lambda: len(engine.requests) >= 4)
            watch_until = time.monotonic() + 0.5
            while time.monotonic() < watch_until:  # all four held: the fifth is never read
                assert len(engine.requests) == 4
                await asyncio.sleep(0.02)
            engine.release.set()
            await asyncio.wait_for(reading, 10)
    finally:
        await server.stop(grace=None)
    assert sorted(int(a.infer_response.id) for a in answers) == list(range(20))
    assert [a.error_message for a in answers if a.error_message] == []


async def test_a_bug_in_a_generation_answers_it_and_the_stream_goes_on(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A generation request failing with a bug (not an engine error) escaped its task and ended
    the whole stream with an error status, failing the stream's other requests with it."""

    async def generate(request: object) -> NoReturn:
        raise RuntimeError("a bug in generation")

    assert await _beside_two_inferences(engine, generate) == [
        ("gen", "internal error"), ("good", ""), ("good", "")
    ]  # fmt: skip
    assert "a bug in generation" in caplog.text  # its traceback, for whoever fixes it


async def test_a_refused_generation_names_its_request(engine: FakeEngine) -> None:
    """A generation refused at admission answered an error without its request's id, which a
    client matching answers to requests by id (as the protocol docs say to) could not place."""

    async def generate(request: object) -> NoReturn:
        raise RateLimited("tenant 'anonymous' is over its rate limit", 1.0)

    assert await _beside_two_inferences(engine, generate) == [
        ("gen", "tenant 'anonymous' is over its rate limit"), ("good", ""), ("good", "")
    ]  # fmt: skip


async def test_a_generation_failing_midway_names_its_request(engine: FakeEngine) -> None:
    """An error chunk (the engine failed the sequence after its first tokens) answered without
    its request's id too; the tokens before it are answered first."""

    async def generate(request: object) -> _Tokens:
        return _Tokens([Chunk([1], "hel"), Chunk([], "", error=BackendError("the step failed"))])

    assert await _beside_two_inferences(engine, generate) == [
        ("gen", ""), ("gen", "the step failed"), ("good", ""), ("good", "")
    ]  # fmt: skip


async def test_a_generation_that_ends_without_an_answer_still_gets_one(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A token stream that ended with no chunk (a bug: the last carries a finish reason or an
    error) left its request unanswered and its slot taken for the rest of the stream."""

    async def generate(request: object) -> _Tokens:
        return _Tokens([])

    assert await _beside_two_inferences(engine, generate) == [
        ("gen", "internal error"), ("good", ""), ("good", "")
    ]  # fmt: skip
    assert "a generation ended without an answer" in caplog.text


class _Tokens:
    """A TokenStream (engine/generation/service.py) giving `chunks` as they are."""

    prompt_tokens = completion_tokens = 1

    def __init__(self, chunks: list[Chunk]) -> None:
        self._chunks = chunks
        self.headers: dict[str, str] = {}

    async def chunks(self) -> AsyncIterator[Chunk]:
        for chunk in self._chunks:
            yield chunk

    def cancel(self) -> None:
        pass


async def _beside_two_inferences(
    engine: FakeEngine, generate: Callable[[object], Awaitable[object]]
) -> list[tuple[str, str]]:
    """The (id, error_message) of every answer, sorted, to one stream carrying a generation
    request (id "gen", served by `generate`) and two inference requests (id "good")."""
    engine.generate = generate  # type: ignore[attr-defined]  # a Generation now
    engine.generative_models = lambda: {"gen"}  # type: ignore[attr-defined]
    prompt = pb.ModelInferRequest(model_name="gen", id="gen")
    prompt.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    prompt.inputs[0].contents.bytes_contents.append(b"hello")
    good = raw_request("double", {"x": ("FP32", np.ones((1, 4), np.float32))}, id="good")
    server, port = await _serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                _requests([prompt, good, good])
            )
            answers = [answer async for answer in call]
            assert await call.code() == grpc.StatusCode.OK
    finally:
        await server.stop(grace=None)
    return sorted((a.infer_response.id, a.error_message) for a in answers)


async def _requests(requests: list[Any]) -> AsyncIterator[Any]:
    for request in requests:
        yield request


async def _collect(call: Any, into: list[Any]) -> None:
    async for answer in call:
        into.append(answer)


async def test_rejected_stream_that_never_stops_writing_still_ends(engine: FakeEngine) -> None:
    """The server reads a rejected stream only up to its bound (or a second), then ends it."""
    keyed = FakeEngine(AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="a")]))
    server, port = await _serve(keyed, grpc_stream_max_pending=4)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def forever() -> AsyncIterator[Any]:
                index = 0
                while True:
                    yield _double(index)
                    index += 1

            call = stub.ModelStreamInfer(forever())
            async with asyncio.timeout(10):
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in call:
                        pass
            # A client still writing when the status comes may see grpc.aio's INTERNAL
            # (grpc/grpc#36066); the point here is that the call ended.
            assert await call.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
    finally:
        await server.stop(grace=None)
    assert keyed.requests == []


async def test_stream_without_a_key_is_unauthenticated_every_time() -> None:
    engine = FakeEngine(AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="a")]))
    server, port = await _serve(engine)
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for attempt in range(30):

                async def requests(count: int = attempt % 8) -> AsyncIterator[Any]:
                    for index in range(count):
                        yield _double(index)

                codes.append((await _status(_drain(stub.ModelStreamInfer(requests())))).code())
    finally:
        await server.stop(grace=None)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 30
    assert engine.requests == []


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def test_a_message_that_does_not_parse_ends_the_stream_after_those_before_it(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The requests read before it are answered; then INVALID_ARGUMENT naming the method, with a
    log line but no traceback (grpc answered UNKNOWN and logged one)."""
    server, port = await _serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(2):
                call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")()
                await call.write(_double(1).SerializeToString())
                await call.write(b"\xff\xff\xff")
                await call.write(_double(2).SerializeToString())  # not read
                await call.done_writing()
                answer = pb.ModelStreamInferResponse.FromString(await call.read())
                assert (answer.infer_response.id, answer.error_message) == ("1", "")
                error = await _status(call.read())
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details() == (
                    "gRPC ModelStreamInfer: the request message could not be parsed as "
                    "inference.ModelInferRequest (3 bytes); send a serialized "
                    "inference.ModelInferRequest"
                )
    finally:
        await server.stop(grace=None)
    assert [r for r in caplog.records if r.exc_info] == []
    assert len([r for r in caplog.records if "could not be parsed" in r.getMessage()]) == 1
    assert [r.inputs["x"][0, 0] for r in engine.requests] == [1.0, 1.0]
