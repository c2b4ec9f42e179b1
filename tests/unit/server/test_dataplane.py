"""The data plane over FakeEngine: authentication and authorization, inference counted, logged
and mapped once, whichever transport calls, and the door of generation (the routes that call it
are tested in http/test_openai.py, http/test_triton_generate.py and grpc/test_stream.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, NoReturn

import numpy as np
import pytest

from engine.auth import digest_key
from engine.errors import (
    BackendError,
    Forbidden,
    InvalidInput,
    ModelNotFound,
    RateLimited,
    ShuttingDown,
    Unauthenticated,
)
from engine.generation.service import GenerateRequest
from engine.settings import ApiKey, AuthSettings
from engine.types import InferRequest, InferResponse
from engine.validate import InputCheck
from server.dataplane import ClientGone, DataPlane
from server.generating import GenerationRoute
from server.ledger import Headers
from server.settings import MetricsSettings, Settings
from tests.unit.server.bodies import WRONG_KINDS, parsed
from tests.unit.server.fake_engine import FakeEngine

KEYS = [
    ApiKey(digest=digest_key("user"), tenant="acme", models=["double"]),
    ApiKey(digest=digest_key("root"), tenant="ops", role="admin"),
]
USER: Headers = {"x-api-key": "user"}
ROOT: Headers = [("x-api-key", "root")]  # gRPC metadata: pairs


class Call:
    """An InferCall of a made-up transport: decodes to a fixed request, encodes to a dict."""

    protocol = "grpc"
    span_name = "test"

    def __init__(self, model: str = "double", headers: Headers = USER, **behaviour: Any) -> None:
        self.model, self.version, self.headers = model, None, headers
        self.access = f"test {model}"
        self.decoded = 0
        self.behaviour = behaviour

    async def decode(self, check: InputCheck) -> InferRequest:
        self.decoded += 1
        x = np.ones((2, 4), np.float32)
        check({"x": x.shape}, {"x": "FP32"})
        if "decode_error" in self.behaviour:
            raise self.behaviour["decode_error"]
        return InferRequest(
            model_name=self.model, model_version=None, inputs={"x": x}, datatypes={"x": "FP32"}
        )

    def encode(self, response: InferResponse) -> dict[str, Any]:
        if "encode_error" in self.behaviour:
            raise self.behaviour["encode_error"]
        return {"y": response.outputs["y"].tolist(), "version": response.model_version}

    async def wait(self, answer: Awaitable[InferResponse]) -> InferResponse:
        if self.behaviour.get("gone"):
            answer.close()  # type: ignore[attr-defined]
            raise ClientGone
        return await answer


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(AuthSettings(keys=KEYS, admin_endpoints=["repository", "statistics"]))


@pytest.fixture
def plane(engine: FakeEngine) -> DataPlane:
    return DataPlane(engine, Settings())  # type: ignore[arg-type]


def counted(engine: FakeEngine) -> dict[tuple[str, ...], float]:
    """sluice_requests_total by (model, version, protocol, status)."""
    return {
        (s.labels["model"], s.labels["version"], s.labels["protocol"], s.labels["status"]): s.value
        for metric in engine.metrics.registry.collect()
        if metric.name == "sluice_requests"
        for s in metric.samples
        if s.name == "sluice_requests_total"
    }


async def test_infer_answers_with_the_tenant_and_counts_once(
    plane: DataPlane, engine: FakeEngine
) -> None:
    answer = await plane.infer(Call())
    assert answer == {"y": [[2.0] * 4] * 2, "version": "1"}
    assert engine.requests[-1].tenant == "acme"
    assert counted(engine) == {("double", "1", "grpc", "200"): 1.0}


@pytest.mark.parametrize(
    ("call", "error", "status"),
    [
        (Call(headers={"x-api-key": "nope"}), Unauthenticated, "401"),
        (Call(model="echo"), Forbidden, "403"),  # acme may use only double
        (Call(decode_error=InvalidInput("bad x")), InvalidInput, "400"),
        (Call(headers=ROOT, model="nope"), ModelNotFound, "404"),
    ],
)
async def test_each_refusal_is_its_engine_error_counted_under_its_status(
    plane: DataPlane, engine: FakeEngine, call: Call, error: type[Exception], status: str
) -> None:
    with pytest.raises(error):
        await plane.infer(call)
    [(labels, count)] = counted(engine).items()
    assert (labels[2:], count) == (("grpc", status), 1.0)
    assert labels[1] == ""  # no version answered


async def test_a_bug_is_logged_once_and_answered_as_an_internal_error(
    plane: DataPlane, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, "sluice.grpc"), pytest.raises(BackendError) as caught:
        await plane.infer(Call(encode_error=ZeroDivisionError("secret detail")))
    assert caught.value.message == "internal error"
    assert [r.getMessage() for r in caplog.records] == ["unhandled error in inference"]
    assert caplog.records[0].exc_info is not None
    assert counted(engine) == {("double", "1", "grpc", "500"): 1.0}


async def test_a_caller_that_leaves_is_499(plane: DataPlane, engine: FakeEngine) -> None:
    with pytest.raises(ClientGone):
        await plane.infer(Call(gone=True))
    assert counted(engine) == {("double", "", "grpc", "499"): 1.0}


async def test_a_cancelled_call_is_499(plane: DataPlane, engine: FakeEngine) -> None:
    call = asyncio.ensure_future(plane.infer(Call(model="slow", headers=ROOT)))
    await asyncio.wait_for(engine.started.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert counted(engine) == {("slow", "", "grpc", "499"): 1.0}


async def test_the_request_carries_its_check_and_its_arrival_to_the_engine(
    plane: DataPlane, engine: FakeEngine
) -> None:
    """The plane runs the engine's input check as the request is decoded and hands the engine
    what it found (InferRequest.checked: the engine checks it no more), and its start time
    (`arrived`: the engine's clock for the request starts there)."""
    before = time.monotonic()
    await plane.infer(Call())
    sent = engine.requests[-1]
    assert sent.checked is not None
    assert sent.checked.rows == 2  # what the engine's check of double said of x [2, 4]
    assert sent.arrived is not None
    assert before <= sent.arrived <= time.monotonic()


async def test_draining_refuses_before_decoding(plane: DataPlane, engine: FakeEngine) -> None:
    engine.draining = True
    call = Call()
    with pytest.raises(ShuttingDown):
        await plane.infer(call)
    assert call.decoded == 0
    assert counted(engine) == {("double", "", "grpc", "503"): 1.0}


async def test_a_given_principal_is_authorized_not_authenticated_again(
    plane: DataPlane, engine: FakeEngine
) -> None:
    caller = plane.authenticate(USER)
    # No key in the headers: authenticating them again would be Unauthenticated.
    assert (await plane.infer(Call(headers={}), caller))["version"] == "1"
    with pytest.raises(Forbidden, match="tenant 'acme' may use models \\[double\\]; got 'echo'"):
        await plane.infer(Call(model="echo", headers={}), caller)


async def test_metadata_and_readiness(plane: DataPlane) -> None:
    assert (await plane.model_metadata(USER, "double", None)).name == "double"
    with pytest.raises(Forbidden):
        await plane.model_metadata(USER, "echo", None)
    assert await plane.model_ready(ROOT, "nope", None) is False  # gRPC: unknown is not ready
    with pytest.raises(ModelNotFound):
        await plane.model_ready(ROOT, "nope", None, unknown_is_error=True)  # HTTP: 404
    assert plane.server_metadata(USER)["name"] == "sluice"
    with pytest.raises(Unauthenticated):
        plane.server_metadata({})


async def test_admin_groups_and_visible_statistics(plane: DataPlane) -> None:
    with pytest.raises(Forbidden, match="statistics endpoints need an admin key"):
        await plane.statistics(USER)
    names = [s["name"] for s in (await plane.statistics(ROOT))["model_stats"]]
    assert names == ["double", "echo", "slow", "types"]
    with pytest.raises(Forbidden, match="repository endpoints need an admin key"):
        plane.repository_caller(USER, "double")
    assert (await plane.model_config(USER, "double", None))["name"] == "double"  # config: not admin


async def test_load_passes_the_parameters_values_on(plane: DataPlane) -> None:
    with pytest.raises(InvalidInput, match="got int"):
        await plane.load_model(ROOT, "echo", {"config": 3}, "grpc")
    await plane.load_model(ROOT, "echo", {"config": '{"max_batch_size": 4}'}, "grpc")


async def test_metrics_need_an_admin_key_only_when_configured(engine: FakeEngine) -> None:
    open_plane = DataPlane(engine, Settings())  # type: ignore[arg-type]
    assert b"sluice_requests" in await open_plane.metrics({})
    locked = DataPlane(engine, Settings(metrics=MetricsSettings(require_key=True)))  # type: ignore[arg-type]
    with pytest.raises(Forbidden, match=r"/metrics \(metrics.require_key\) needs an admin key"):
        await locked.metrics(USER)
    assert b"sluice_requests" in await locked.metrics(ROOT)


async def test_metrics_need_an_admin_key_by_default_off_loopback(engine: FakeEngine) -> None:
    """The metrics name tenants: a server bound beyond loopback shows them to admins only,
    unless told otherwise (before, `require_key` defaulted to false: anyone could read them)."""
    public = DataPlane(engine, Settings(host="0.0.0.0"))  # type: ignore[arg-type]
    with pytest.raises(Forbidden) as caught:
        await public.metrics(USER)
    assert caught.value.message == (
        "tenant 'acme' has role 'user'; /metrics on a server bound to 0.0.0.0 "
        "(metrics.require_key unset; metrics.port serves them without a key) needs an admin key"
    )
    with pytest.raises(Unauthenticated):
        await public.metrics({})
    assert b"sluice_requests" in await public.metrics(ROOT)
    loopback = DataPlane(engine, Settings())  # type: ignore[arg-type]
    assert b"sluice_requests" in await loopback.metrics(USER)
    opted_out = DataPlane(
        engine, Settings(host="0.0.0.0", metrics=MetricsSettings(require_key=False))
    )  # type: ignore[arg-type]
    assert b"sluice_requests" in await opted_out.metrics(USER)


# -- generation ----------------------------------------------------------------------------------


def route(headers: Headers = USER) -> GenerationRoute:
    return GenerationRoute("http", "POST /v1/completions", "POST /v1/completions", headers)


@pytest.mark.parametrize(("value", "shown"), WRONG_KINDS)
def test_a_model_of_the_wrong_kind_is_named_as_sent(
    plane: DataPlane, value: str, shown: str
) -> None:
    call = plane.generation_call(route())
    with pytest.raises(InvalidInput) as caught:
        call.choose(parsed(f'{{"model": {value}}}')["model"])
    assert caught.value.message == f"model must be a model name (string); got {shown}"


def test_a_generation_caller_is_authenticated_authorized_and_refused_while_draining(
    plane: DataPlane, engine: FakeEngine
) -> None:
    assert plane.generation_call(route(), "double").tenant == "acme"
    with pytest.raises(Unauthenticated):
        plane.generation_call(route({"x-api-key": "nope"}), "double")
    with pytest.raises(Forbidden, match="tenant 'acme' may use models \\[double\\]; got 'echo'"):
        plane.generation_call(route(), "echo")
    engine.draining = True
    with pytest.raises(ShuttingDown):
        plane.generation_call(route(), "double")
    # Each refusal counted once, by the plane (the model of a stranger's request is not named).
    assert counted(engine) == {
        ("_unknown", "", "http", "401"): 1.0,
        ("echo", "", "http", "403"): 1.0,
        ("double", "", "http", "503"): 1.0,
    }


async def test_an_engine_without_generation_serves_no_generative_model(plane: DataPlane) -> None:
    assert (plane.serves_generation, plane.generative_models()) == (False, [])
    with pytest.raises(ModelNotFound, match="unknown model 'double'"):
        await plane.generation_call(route(), "double").start(
            [GenerateRequest("double", "acme", "hello")]
        )


async def test_a_refused_generation_keeps_its_error_and_a_bug_is_an_internal_error(
    plane: DataPlane, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(request: GenerateRequest) -> NoReturn:
        raise RateLimited("tenant 'acme' is over its rate limit", 1.0)

    engine.generate = refuse  # type: ignore[attr-defined]  # a Generation now
    engine.generative_models = lambda: ["gen"]  # type: ignore[attr-defined]
    assert (plane.serves_generation, plane.generative_models()) == (True, ["gen"])
    with pytest.raises(RateLimited, match="over its rate limit"):
        await plane.generation_call(route(ROOT), "gen").start([GenerateRequest("gen", "ops", "hi")])

    async def bug(request: GenerateRequest) -> NoReturn:
        raise ZeroDivisionError("secret detail")

    engine.generate = bug  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR, "sluice.generation"), pytest.raises(BackendError) as caught:
        await plane.generation_call(route(ROOT), "gen").start([GenerateRequest("gen", "ops", "hi")])
    assert caught.value.message == "internal error"
    assert [r.getMessage() for r in caplog.records] == ["unhandled error in generation"]
    assert caplog.records[0].exc_info is not None
    assert counted(engine) == {
        ("_unknown", "", "http", "429"): 1.0,
        ("_unknown", "", "http", "500"): 1.0,
    }
