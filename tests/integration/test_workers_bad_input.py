"""The bad-input corpus against `sluice serve --workers 2`, answer for answer against one process
(tests/integration/test_bad_input_corpus.py has the strategies). Every request goes to both
servers: status and body must be the same, and the workers' server must end as it began: no
worker restarted, every arena slot free, and SIGTERM drained at once (nothing left counted in
flight). Where a worker must answer otherwise (a request past what the engine channel or the
worker arenas carry), the answer is a precise 4xx and nothing else is disturbed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.http.binary import HEADER_LENGTH
from server.link.frames import MAX_FRAME_BYTES
from tests.integration import test_bad_input_corpus as corpus
from tests.integration.test_workers import wait_for, worker_samples
from tests.models import (
    write_sleeping_model,
)
from tests.servers import ServerProcess

ARENA_BYTES = 1 << 20  # the smallest allowed: a request can pass it
DIFFERENTIAL = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip


class Pair:
    """One process and two workers over the same repository, and a client of each."""

    def __init__(self, one: ServerProcess, two: ServerProcess) -> None:
        self.servers = (one, two)
        self.http = tuple(httpx.Client(base_url=s.url, timeout=30) for s in self.servers)
        options = [("grpc.max_send_message_length", 100 << 20)]
        self.channels = tuple(grpc.insecure_channel(s.grpc_url, options) for s in self.servers)
        self.stubs = tuple(pb_grpc.GRPCInferenceServiceStub(c) for c in self.channels)

    def post(self, path: str, body: bytes, headers: Any = None) -> list[tuple[int, str]]:
        replies = [client.post(path, content=body, headers=headers) for client in self.http]
        return [(reply.status_code, reply.text) for reply in replies]

    def call(self, method: str, message: Any, timeout_s: float = 30) -> list[tuple[str, str]]:
        answers = []
        for stub in self.stubs:
            try:
                reply = getattr(stub, method)(message, timeout=timeout_s)
                answers.append(("OK", reply.SerializeToString().hex()))
            except grpc.RpcError as exc:
                answers.append((exc.code().name, exc.details()))
        return answers


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("workers-corpus")
    repo = corpus.corpus_repository(root)
    write_sleeping_model(repo)
    common = ("--model-repository", str(repo), "--allow-python-models", "--drain-timeout-s", "10")
    env = {"SLUICE_WORKER_ARENA_BYTES": str(ARENA_BYTES)}
    one = ServerProcess(*common, env=env, log_path=root / "one.log").start()
    two = ServerProcess(*common, "--workers", "2", env=env, log_path=root / "two.log").start()
    pair = Pair(one, two)
    try:
        yield pair
        samples = worker_samples(two)
        assert {samples[f'sluice_worker_restarts_total{{worker="{w}"}}'] for w in "01"} == {0}
        for log in (root / "one.log", root / "two.log"):
            assert "Exception in ASGI application" not in log.read_text()
            assert "protocol error" not in log.read_text()
        two.terminate()  # nothing is left in flight: the drain ends at once, not at its bound
        started = time.monotonic()
        assert two.wait(15) == 0
        assert time.monotonic() - started < 5, "a request stayed counted in flight"
    finally:
        for client in pair.http:
            client.close()
        for channel in pair.channels:
            channel.close()
        one.stop()
        two.stop()


def same(answers: list[Any]) -> None:
    one, two = answers
    assert two == one, f"one process: {one!r:.300}; workers: {two!r:.300}"


# -- the corpus, answer for answer ------------------------------------------------------------


@DIFFERENTIAL
@given(case=corpus.near_valid())
def test_json_requests_answer_as_one_process(pair: Pair, case: Any) -> None:
    model, body, _, _ = case
    same(pair.post(f"/v2/models/{model}/infer", corpus.dumps(corpus.untimed(body))))


@DIFFERENTIAL
@given(model=st.sampled_from(corpus.MODELS), body=corpus.requests())
def test_malformed_json_requests_answer_as_one_process(
    pair: Pair, model: str, body: dict[str, Any]
) -> None:
    same(pair.post(f"/v2/models/{model}/infer", corpus.dumps(corpus.untimed(body))))


@DIFFERENTIAL
@given(case=corpus.near_valid(), seed=st.binary(max_size=24), extra=st.sampled_from([0, 1, -1]))
def test_binary_requests_answer_as_one_process(
    pair: Pair, case: Any, seed: bytes, extra: int
) -> None:
    model, body, datatype, shape = case
    tensor = body["inputs"][0]
    data = corpus.raw_tensor(datatype, shape, seed)
    data = data[:extra] if extra < 0 else data + bytes(extra)
    del tensor["data"]
    tensor["parameters"] = {"binary_data_size": len(data)}
    header = corpus.dumps(corpus.untimed(body))
    same(pair.post(f"/v2/models/{model}/infer", header + data, {HEADER_LENGTH: str(len(header))}))


@DIFFERENTIAL
@given(message=corpus.grpc_requests())
def test_grpc_requests_answer_as_one_process(pair: Pair, message: Any) -> None:
    same(pair.call("ModelInfer", corpus.untimed_message(message)))


# -- what only a worker carries ---------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_load_parameters_json_cannot_carry_answer_as_one_process(pair: Pair) -> None:
    """bytes (gRPC) and nesting past orjson's 254 levels (HTTP) failed to encode for the engine
    process: 500 / INTERNAL, where one process answers 400 naming the parameter."""
    body = json.dumps({"parameters": {"x": nested(300)}}).encode()
    answers = pair.post("/v2/repository/models/demo/load", body)
    same(answers)
    assert answers[0][0] == 400
    config = pb.ModelRepositoryParameter(bytes_param=b"\xff")
    load = pb.RepositoryModelLoadRequest(model_name="demo", parameters={"config": config})
    codes = pair.call("RepositoryModelLoad", load)
    same(codes)
    assert codes[0][0] == "INVALID_ARGUMENT"


def test_a_request_past_the_engine_channel_is_413_and_the_worker_serves_on(pair: Pair) -> None:
    """11 MiB of control characters in a gRPC string parameter (80 MiB allowed) is 66 MiB as
    JSON: the engine closed the worker's connection, the worker restarted, and every request it
    had in flight failed. Its own answer now says why; one process, which sends nothing, serves
    it."""
    message = pb.ModelInferRequest(model_name="demo")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(bytes(64))
    message.parameters["tag"].string_param = "\x01" * (11 << 20)
    one, two = pair.call("ModelInfer", message)
    assert one[0] == "OK"
    assert two[0] == "RESOURCE_EXHAUSTED"
    assert f"more than the {MAX_FRAME_BYTES} bytes such a message may hold" in two[1]
    del message.parameters["tag"]
    assert pair.call("ModelInfer", message)[1][0] == "OK"


def test_calls_cancelled_past_their_deadline_leave_no_arena_slot_taken(pair: Pair) -> None:
    """A gRPC deadline that passes while the request's batch runs: each such call held its
    in-arena slot until the engine's collector ran (rarely), so enough of them filled the
    worker's arena and it answered every request after them 503."""
    _, two = pair.servers
    message = pb.ModelInferRequest(model_name="slow")
    message.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    message.raw_input_contents.append(np.ones((2, 4), np.float32).tobytes())
    stub = pair.stubs[1]
    for _ in range(6):
        with pytest.raises(grpc.RpcError) as late:
            stub.ModelInfer(message, timeout=0.2)  # the batch runs 0.4 s
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def used() -> set[float]:
        return {value for name, value in worker_samples(two).items()
                if name.startswith("sluice_worker_arena_used_bytes")}  # fmt: skip

    wait_for(lambda: used() == {0}, f"every arena slot freed ({used()})", timeout_s=5)
    assert stub.ModelInfer(message, timeout=30).model_name == "slow"
