"""The gRPC servicer and its server (server/grpc/service.py) over a real grpc.aio server on a free
port, backed by FakeEngine (real ONNX Runtime sessions at the engine-facade seam): every unary RPC,
authentication, limits and the call clock. Its streams are tested in test_stream.py, how an
engine error ends a call in test_calls.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import json_format

from engine.auth import digest_key
from engine.regions import SystemRegions
from engine.settings import ApiKey, AuthSettings, SettingsError, SharedMemorySettings
from server.grpc import tensors
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.grpc.service import CallClock, GrpcService, build_grpc_server, server_options
from server.settings import Settings
from tests.fakes.cuda_client import IpcClient
from tests.fakes.cuda_runtime import FakeCudaRuntime
from tests.fakes.install import install_cuda
from tests.unit.server.fake_engine import MAX_BATCH_SIZE, FakeEngine
from tests.unit.server.grpc.serving import Stub, _serve, _status, output, raw_request


async def test_health_and_server_metadata(stub: Stub, engine: FakeEngine) -> None:
    assert (await stub.ServerLive(pb.ServerLiveRequest())).live is True
    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready is True
    engine.ready = False
    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready is False
    meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
    assert (meta.name, meta.version, list(meta.extensions)) == (
        "sluice",
        "0.1.0",
        ["binary_tensor_data"],
    )


async def test_model_ready_and_metadata(stub: Stub) -> None:
    assert (await stub.ModelReady(pb.ModelReadyRequest(name="double"))).ready is True
    assert (await stub.ModelReady(pb.ModelReadyRequest(name="double", version="7"))).ready is False
    assert (await stub.ModelReady(pb.ModelReadyRequest(name="nope"))).ready is False
    meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="double"))
    assert meta.name == "double"
    assert list(meta.versions) == ["1"]
    assert meta.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4])]
    assert [(t.name, list(t.shape)) for t in meta.outputs] == [("y", [-1, 4]), ("total", [-1])]
    error = await _status(stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown model 'nope'" in error.details()


async def test_infer_raw_contents(stub: Stub, engine: FakeEngine) -> None:
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    response = await stub.ModelInfer(raw_request("double", {"x": ("FP32", x)}, id="r1"))
    assert (response.model_name, response.model_version, response.id) == ("double", "1", "r1")
    assert [o.name for o in response.outputs] == ["y", "total"]
    np.testing.assert_array_equal(output(response, "y"), 2 * x)
    np.testing.assert_allclose(output(response, "total"), x.sum(axis=1), rtol=1e-6)
    assert engine.requests[-1].tenant == "anonymous"
    assert not engine.requests[-1].inputs["x"].flags.writeable  # a view of the message bytes


async def test_infer_typed_contents_and_output_selection(stub: Stub) -> None:
    request = pb.ModelInferRequest(model_name="double", model_version="1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    tensor.contents.fp32_contents.extend([float(i) for i in range(8)])
    request.outputs.add(name="total")
    response = await stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["total"]
    np.testing.assert_array_equal(output(response, "total"), [6.0, 22.0])


async def test_bytes_tensors_raw_and_typed(stub: Stub) -> None:
    items = [b"hello", b"", "h\u00e9".encode()]
    raw = b"".join(struct.pack("<I", len(i)) + i for i in items)
    request = pb.ModelInferRequest(model_name="echo", raw_input_contents=[raw])
    request.inputs.add(name="text", datatype="BYTES", shape=[3])
    response = await stub.ModelInfer(request)
    assert response.outputs[0].datatype == "BYTES"
    assert response.raw_output_contents[0] == raw

    typed = pb.ModelInferRequest(model_name="echo")
    typed.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(items)
    assert (await stub.ModelInfer(typed)).raw_output_contents[0] == raw


async def test_narrow_int_fp16_and_bool(stub: Stub) -> None:
    a = np.array([[-128, 127], [0, 5]], np.int8)
    h = np.array([[0.5, -2], [65504, 1e-3]], np.float16)
    flag = np.array([[True, False], [False, True]])
    response = await stub.ModelInfer(
        raw_request("types", {"a": ("INT8", a), "h": ("FP16", h), "flag": ("BOOL", flag)})
    )
    np.testing.assert_array_equal(output(response, "a_out"), a)
    np.testing.assert_array_equal(output(response, "h_out"), h)
    np.testing.assert_array_equal(output(response, "flag_out"), flag)

    typed = pb.ModelInferRequest(model_name="types")
    typed.inputs.add(name="a", datatype="INT8", shape=[2, 2]).contents.int_contents.extend(
        [-128, 127, 0, 5]
    )
    typed.inputs.add(name="h", datatype="FP16", shape=[2, 2])
    typed.inputs.add(name="flag", datatype="BOOL", shape=[2, 2]).contents.bool_contents.extend(
        [True, False, False, True]
    )
    error = await _status(stub.ModelInfer(typed))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'h' is FP16, which has no typed contents field" in error.details()


def _typed(datatype: str, shape: list[int], **contents: Any) -> Any:
    request = pb.ModelInferRequest(model_name="double")
    request.inputs.add(name="x", datatype=datatype, shape=shape, contents=contents or None)
    return request


def _raw_wrong_size() -> Any:
    request = pb.ModelInferRequest(model_name="double", raw_input_contents=[bytes(28)])
    request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    return request


def _mixed() -> Any:
    request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
    request.inputs[0].contents.fp32_contents.extend([0.0] * 4)
    return request


def _two_inputs_one_raw() -> Any:
    request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
    request.inputs.add(name="z", datatype="FP32", shape=[1])
    return request


@pytest.mark.parametrize(
    ("request_factory", "message"),
    [
        (
            _raw_wrong_size,
            "input 'x' has shape [2, 4] of FP32, which is 32 bytes; received 28 bytes",
        ),
        (
            _two_inputs_one_raw,
            "request has 2 inputs outside shared memory but 1 raw_input_contents entries",
        ),
        (
            lambda: _typed("FP32", [2, 4], fp32_contents=[1.0] * 7),
            "input 'x' has shape [2, 4] (8 elements) but contents.fp32_contents holds 7",
        ),
        (
            lambda: _typed("FP32", [1, 4], int_contents=[1] * 4),
            "input 'x' is FP32, so its data goes in contents.fp32_contents; got "
            "contents.int_contents",
        ),
        (lambda: _typed("FP99", [1, 4]), "input 'x': unknown datatype 'FP99'"),
        (lambda: _typed("FP32", [-1, 4]), "non-negative integers, got [-1, 4]"),
        (_mixed, "input 'x' has both contents and raw_input_contents"),
        (
            lambda: raw_request(
                "echo", {"text": ("BYTES", np.frombuffer(b"\x09\0\0\0ab", np.uint8))}
            ),
            "input 'text': BYTES element 0 declares 9 bytes; only 2 remain",
        ),
    ],
)
async def test_malformed_contents_are_invalid_argument(
    stub: Stub, request_factory: Any, message: str
) -> None:
    error = await _status(stub.ModelInfer(request_factory()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


async def test_declared_shapes_are_checked_against_the_model_before_decoding(
    stub: Stub, engine: FakeEngine
) -> None:
    # One row too many for the model; the raw contents hold one row only, so the answer names
    # the batch limit only if the check runs on the declared shape, before decoding.
    rows = MAX_BATCH_SIZE + 1
    request = pb.ModelInferRequest(model_name="double")
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.zeros(4, np.float32).tobytes())
    error = await _status(stub.ModelInfer(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"batch size {rows} exceeds the maximum of {MAX_BATCH_SIZE} for double"
    )
    assert engine.requests == []


async def test_parameters_deadline_and_tenant_reach_the_engine(
    stub: Stub, engine: FakeEngine
) -> None:
    request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
    request.parameters["priority"].int64_param = 2
    request.parameters["timeout"].int64_param = 5_000_000  # microseconds, as Triton
    request.parameters["custom"].string_param = "v"
    await stub.ModelInfer(request, timeout=2.0)
    seen = engine.requests[-1]
    assert seen.priority == 2
    assert seen.timeout_s is not None
    assert 0 < seen.timeout_s < 3.0  # the call's 2 s deadline (not exact: clocks) beats 5 s
    assert seen.parameters["custom"] == "v"

    request.parameters["priority"].int64_param = -1
    error = await _status(stub.ModelInfer(request))
    assert "parameter 'priority' must be a non-negative integer, got -1" in error.details()


async def test_client_cancellation_reaches_the_engine(stub: Stub, engine: FakeEngine) -> None:
    call = stub.ModelInfer(raw_request("slow", {"x": ("FP32", np.zeros((1, 4), np.float32))}))
    await asyncio.wait_for(engine.started.wait(), 10)
    call.cancel()
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert engine.cancelled.is_set()


async def test_model_config_in_tritons_shape(stub: Stub) -> None:
    response = await stub.ModelConfig(pb.ModelConfigRequest(name="double"))
    config = response.config
    assert (config.name, config.platform, config.max_batch_size) == (
        "double",
        "onnxruntime_onnx",
        MAX_BATCH_SIZE,
    )
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", 11, [4])]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].kind == 2  # KIND_CPU
    assert config.version_policy.latest.num_versions == 1
    as_json = json_format.MessageToDict(config)
    assert as_json["output"][1] == {"name": "total", "dataType": "TYPE_FP32"}


async def test_statistics(stub: Stub) -> None:
    await stub.ModelInfer(raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))}))
    stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="double"))
    assert [(s.name, s.version, s.inference_count) for s in stats.model_stats] == [
        ("double", "1", 1)
    ]
    assert stats.model_stats[0].inference_stats.success.count == 1
    assert stats.model_stats[0].batch_stats[0].batch_size == 1
    everything = await stub.ModelStatistics(pb.ModelStatisticsRequest())
    assert sorted(s.name for s in everything.model_stats) == ["double", "echo", "slow", "types"]


async def test_repository_index_load_unload(stub: Stub) -> None:
    await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="echo"))
    index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    states = {m.name: (m.state, m.reason) for m in index.models}
    assert states["echo"] == ("UNAVAILABLE", "unloaded")
    assert states["double"] == ("READY", "")
    ready = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    assert "echo" not in {m.name for m in ready.models}
    await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="echo"))
    assert (await stub.ModelReady(pb.ModelReadyRequest(name="echo"))).ready is True

    error = await _status(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="x")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    load = pb.RepositoryModelLoadRequest(model_name="echo")
    load.parameters["config"].string_param = '{"max_batch_size": 4}'
    await stub.RepositoryModelLoad(load)  # a valid JSON model config is taken
    load.parameters["config"].string_param = '{"max_batch_size": "many"}'
    error = await _status(stub.RepositoryModelLoad(load))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid configuration in load parameter 'config'" in error.details()
    assert "max_batch_size" in error.details()
    load.parameters["config"].int64_param = 3
    error = await _status(stub.RepositoryModelLoad(load))
    assert "'config' must be a JSON string holding the model config, got int" in error.details()
    del load.parameters["config"]
    load.parameters["file:1/model.onnx"].bytes_param = b"onnx"
    error = await _status(stub.RepositoryModelLoad(load))
    assert "unknown load parameters file:1/model.onnx; allowed: config" in error.details()
    unload = pb.RepositoryModelUnloadRequest(model_name="echo")
    unload.parameters["unload_dependents"].bool_param = False
    await stub.RepositoryModelUnload(unload)
    unload.parameters["force"].bool_param = True
    error = await _status(stub.RepositoryModelUnload(unload))
    assert "unknown unload parameters force; allowed: unload_dependents" in error.details()


UNIMPLEMENTED = {
    "TraceSetting": pb.TraceSettingRequest,
    "LogSettings": pb.LogSettingsRequest,
}


@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED))
async def test_unimplemented_rpcs(stub: Stub, name: str) -> None:
    error = await _status(getattr(stub, name)(UNIMPLEMENTED[name]()))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert error.details().startswith(f"sluice does not implement {name}: ")
    assert dict(error.trailing_metadata() or ())["x-request-id"]


def test_every_rpc_is_served_by_the_servicer() -> None:
    """No RPC falls through to the generated base class (NotImplementedError, a traceback)."""
    base = pb_grpc.GRPCInferenceServiceServicer
    rpcs = [name for name in vars(base) if not name.startswith("_")]
    assert len(rpcs) == 20
    assert [name for name in rpcs if getattr(GrpcService, name) is getattr(base, name)] == []


async def test_unimplemented_rpcs_need_a_key() -> None:
    engine = FakeEngine(AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="a")]))
    server, port = await _serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            error = await _status(stub.TraceSetting(pb.TraceSettingRequest()))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            keyed = stub.TraceSetting(pb.TraceSettingRequest(), metadata=(("x-api-key", "k"),))
            assert (await _status(keyed)).code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(grace=None)


async def test_auth_from_metadata() -> None:
    keys = [
        ApiKey(digest=digest_key("user-key"), tenant="acme", models=["double"]),
        ApiKey(digest=digest_key("admin-key"), tenant="ops", role="admin"),
    ]
    engine = FakeEngine(AuthSettings(keys=keys, admin_endpoints=["repository", "statistics"]))
    server, port = await _serve(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
            assert (await stub.ServerLive(pb.ServerLiveRequest())).live  # probes need no key
            error = await _status(stub.ModelInfer(request))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "missing API key" in error.details()
            await stub.ModelInfer(request, metadata=(("authorization", "Bearer user-key"),))
            assert engine.requests[-1].tenant == "acme"
            await stub.ModelInfer(request, metadata=(("x-api-key", "admin-key"),))
            assert engine.requests[-1].tenant == "ops"
            user = (("x-api-key", "user-key"),)
            echo = pb.ModelMetadataRequest(name="echo")
            assert (await _status(stub.ModelMetadata(echo, metadata=user))).code() == (
                grpc.StatusCode.PERMISSION_DENIED
            )
            index = pb.RepositoryIndexRequest()
            error = await _status(stub.RepositoryIndex(index, metadata=user))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "repository endpoints need an admin key" in error.details()
            admin = (("x-api-key", "admin-key"),)
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(), metadata=admin)
            assert len(stats.model_stats) == 4
            config = await stub.ModelConfig(pb.ModelConfigRequest(name="double"), metadata=user)
            assert config.config.name == "double"  # config is not admin-only here
            twice = (("x-api-key", "user-key"), ("x-api-key", "admin-key"))
            error = await _status(stub.ModelInfer(request, metadata=twice))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == "header 'x-api-key' is sent 2 times; send it once"
    finally:
        await server.stop(grace=None)


async def test_message_size_limit(engine: FakeEngine) -> None:
    server, port = await _serve(engine, grpc_max_message_bytes=64 * 1024)
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 24)]
        ) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            x = np.zeros((32 * 1024, 4), np.float32)  # 512 KiB
            error = await _status(stub.ModelInfer(raw_request("double", {"x": ("FP32", x)})))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(grace=None)
    limits = dict(server_options(Settings()))
    assert limits["grpc.max_receive_message_length"] >= 64 * 1024 * 1024 + 64 * 1024
    assert limits["grpc.max_send_message_length"] >= 64 * 1024 * 1024 + 64 * 1024


async def test_port_in_use_is_a_settings_error(engine: FakeEngine) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SettingsError, match=f"cannot listen on 127.0.0.1:{port} for gRPC"):
            build_grpc_server(Settings(grpc_port=port), engine)  # type: ignore[arg-type]


async def test_the_call_clock_sees_every_kind_of_call(engine: FakeEngine) -> None:
    clock = CallClock()
    server, port = build_grpc_server(Settings(grpc_port=0), engine, clock=clock)  # type: ignore[arg-type]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            x = np.ones((1, 4), np.float32)
            calls = [
                lambda: stub.ServerLive(pb.ServerLiveRequest()),
                lambda: stub.ModelInfer(raw_request("double", {"x": ("FP32", x)})),
                lambda: _status(stub.TraceSetting(pb.TraceSettingRequest())),
            ]
            for call in calls:
                clock.last_call_at = 0.0
                await call()
                assert clock.last_call_at > 0.0
            clock.last_call_at = 0.0
            stream = stub.ModelStreamInfer()
            await stream.write(raw_request("double", {"x": ("FP32", x)}, id="s"))
            assert (await stream.read()).infer_response.id == "s"
            await stream.done_writing()
            assert clock.last_call_at > 0.0
    finally:
        await server.stop(grace=None)


GARBAGE = b"\xff\xff\xff"
"""Not a protobuf message of any type (field number 0 is invalid)."""


async def _raw_call(channel: grpc.aio.Channel, rpc: str, raw: bytes, **kw: Any) -> Any:
    """`raw` sent as the request message of `rpc`, unparsed on this side."""
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
    return await _status(call(raw, **kw))


UNARY_RPCS = sorted(
    m.name
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    if not m.client_streaming
)


async def test_a_message_that_does_not_parse_is_invalid_argument_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every unary RPC; after the key check (the probes need none); and 3 bad calls of each RPC
    log one line per RPC, no traceback (grpc answered UNKNOWN and logged one per call)."""
    key = (("x-api-key", "k"),)
    engine = FakeEngine(AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="a")]))
    server, port = await _serve(engine)
    caplog.set_level("INFO")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for rpc in UNARY_RPCS:
                for _ in range(3):
                    error = await _raw_call(channel, rpc, GARBAGE, metadata=key)
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
                    assert error.details().startswith(
                        f"gRPC {rpc}: the request message could not be parsed as inference."
                    )
                    assert dict(error.trailing_metadata() or ())["x-request-id"]
                error = await _raw_call(channel, rpc, GARBAGE)  # no key
                expected = (
                    grpc.StatusCode.INVALID_ARGUMENT
                    if rpc in ("ServerLive", "ServerReady")
                    else grpc.StatusCode.UNAUTHENTICATED
                )
                assert error.code() == expected, rpc
    finally:
        await server.stop(grace=None)
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    lines = [r.getMessage() for r in caplog.records if "could not be parsed" in r.getMessage()]
    assert len(lines) == len(UNARY_RPCS) == 19
    assert lines[0] == (
        "gRPC CudaSharedMemoryRegister: a request message could not be parsed as "
        "inference.CudaSharedMemoryRegisterRequest (answered INVALID_ARGUMENT; 0 more such "
        "calls since the last line)"
    )


async def test_calls_past_the_streams_limit_wait_on_their_connection(engine: FakeEngine) -> None:
    # One connection may have grpc_max_concurrent_streams calls open: its others wait in the
    # client (no message of theirs reaches the server) while another connection is served.
    server, port = await _serve(engine, grpc_max_concurrent_streams=2)
    x = np.zeros((1, 4), np.float32)
    apart = [("grpc.use_local_subchannel_pool", 1)]  # two connections, not one shared
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=apart) as first,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=apart) as second,
        ):
            for channel in (first, second):  # connected, the server's limit known to the client
                await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest())
            calls = [
                pb_grpc.GRPCInferenceServiceStub(first).ModelInfer(
                    raw_request("slow", {"x": ("FP32", x)}, id=f"a{i}")
                )
                for i in range(5)
            ]
            while len(engine.requests) < 2:  # noqa: ASYNC110 (the fake engine has no event for it)
                await asyncio.sleep(0.01)
            other = pb_grpc.GRPCInferenceServiceStub(second).ModelInfer(
                raw_request("slow", {"x": ("FP32", x)}, id="b")
            )
            while "b" not in [r.id for r in engine.requests]:  # noqa: ASYNC110 (as above)
                await asyncio.sleep(0.01)
            assert sorted(r.id for r in engine.requests)[-1] == "b"
            assert len(engine.requests) == 3, [r.id for r in engine.requests]
            engine.release.set()
            answers = await asyncio.wait_for(asyncio.gather(*calls, other), 10)
            assert sorted(a.id for a in answers) == ["a0", "a1", "a2", "a3", "a4", "b"]
    finally:
        await server.stop(grace=None)


# -- system shared memory --------------------------------------------------------------------------


def _shm_engine(folder: Path, enabled: bool = True) -> FakeEngine:
    keys = [ApiKey(digest=digest_key(k), tenant=k, name=k) for k in ("a", "b")]
    regions = SystemRegions(SharedMemorySettings(enabled=enabled), folder)
    return FakeEngine(AuthSettings(keys=keys), regions)


def _shm_infer(region: str, size: int) -> Any:
    """`double` with input `x` [2, 4] in `region`, `z` raw after it, and output `y` in region
    `out` at offset 8."""
    request = pb.ModelInferRequest(model_name="double")
    x = request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    x.parameters["shared_memory_region"].string_param = region
    x.parameters["shared_memory_byte_size"].int64_param = size
    y = request.outputs.add(name="y")
    y.parameters["shared_memory_region"].string_param = "out"
    y.parameters["shared_memory_byte_size"].int64_param = 32
    y.parameters["shared_memory_offset"].int64_param = 8
    request.outputs.add(name="total")
    return request


async def test_system_shared_memory_round_trip(tmp_path: Path) -> None:
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    (tmp_path / "in").write_bytes(x.tobytes())
    (tmp_path / "out").write_bytes(bytes(48))
    engine = _shm_engine(tmp_path)
    server, port = await _serve(engine)
    a, b = (("x-api-key", "a"),), (("x-api-key", "b"),)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            register = pb.SystemSharedMemoryRegisterRequest
            await stub.SystemSharedMemoryRegister(
                register(name="in", key="/in", byte_size=32), metadata=a
            )
            await stub.SystemSharedMemoryRegister(
                register(name="out", key="/out", byte_size=48), metadata=a
            )
            status = await stub.SystemSharedMemoryStatus(
                pb.SystemSharedMemoryStatusRequest(), metadata=a
            )
            assert sorted(status.regions) == ["in", "out"]
            assert (status.regions["in"].key, status.regions["in"].byte_size) == ("/in", 32)
            response = await stub.ModelInfer(_shm_infer("in", 32), metadata=a)
            assert list(response.raw_output_contents[0]) == []  # y went to the region
            assert tensors.parameters(response.outputs[0].parameters) == {
                "shared_memory_region": "out",
                "shared_memory_byte_size": 32,
                "shared_memory_offset": 8,
            }
            np.testing.assert_allclose(output(response, "total"), x.sum(axis=1), rtol=1e-6)
            written = np.frombuffer((tmp_path / "out").read_bytes()[8:40], np.float32)
            np.testing.assert_array_equal(written.reshape(2, 4), 2 * x)
            # Another tenant: unknown region, nothing listed.
            error = await _status(stub.ModelInfer(_shm_infer("in", 32), metadata=b))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert "no shared memory region 'in'" in error.details()
            empty = await stub.SystemSharedMemoryStatus(
                pb.SystemSharedMemoryStatusRequest(), metadata=b
            )
            assert dict(empty.regions) == {}
            error = await _status(stub.ModelInfer(_shm_infer("in", 28), metadata=a))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "(32 bytes) but shared_memory_byte_size 28" in error.details()
            await stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name="in"), metadata=a
            )
            error = await _status(stub.ModelInfer(_shm_infer("in", 32), metadata=a))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            await stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(), metadata=a
            )
            assert engine.regions.count() == 0
    finally:
        await server.stop(grace=None)


async def test_system_shared_memory_off_is_permission_denied(tmp_path: Path) -> None:
    (tmp_path / "in").write_bytes(bytes(32))
    server, port = await _serve(_shm_engine(tmp_path, enabled=False))
    a = (("x-api-key", "a"),)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = pb.SystemSharedMemoryRegisterRequest(name="in", key="/in", byte_size=32)
            for call in (
                stub.SystemSharedMemoryRegister(request, metadata=a),
                stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), metadata=a),
                stub.ModelInfer(_shm_infer("in", 32), metadata=a),
            ):
                error = await _status(call)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "SLUICE_SHARED_MEMORY__ENABLED=true" in error.details()
            cuda = pb.CudaSharedMemoryRegisterRequest(
                name="r", raw_handle=bytes(64), device_id=0, byte_size=64
            )
            for call in (
                stub.CudaSharedMemoryRegister(cuda, metadata=a),
                stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), metadata=a),
                stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), metadata=a),
            ):
                error = await _status(call)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "SLUICE_SHARED_MEMORY__ENABLED=true" in error.details()
    finally:
        await server.stop(grace=None)


async def test_cuda_shared_memory_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_cuda = FakeCudaRuntime()
    install_cuda(monkeypatch, server_cuda)
    client = IpcClient()
    x = np.random.default_rng(6).standard_normal((2, 4)).astype(np.float32)
    _, in_handle = client.allocate(x.tobytes())
    out_ptr, out_handle = client.allocate(bytes(48))
    engine = _shm_engine(tmp_path)
    server, port = await _serve(engine)
    a, b = (("x-api-key", "a"),), (("x-api-key", "b"),)
    register = pb.CudaSharedMemoryRegisterRequest
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # raw_handle is the handle's bytes as they are over gRPC (base64 is HTTP's).
            await stub.CudaSharedMemoryRegister(
                register(name="in", raw_handle=in_handle, device_id=0, byte_size=32), metadata=a
            )
            await stub.CudaSharedMemoryRegister(
                register(name="out", raw_handle=out_handle, device_id=0, byte_size=48), metadata=a
            )
            status = await stub.CudaSharedMemoryStatus(
                pb.CudaSharedMemoryStatusRequest(), metadata=a
            )
            assert sorted(status.regions) == ["in", "out"]
            assert (status.regions["out"].device_id, status.regions["out"].byte_size) == (0, 48)
            response = await stub.ModelInfer(_shm_infer("in", 32), metadata=a)
            assert list(response.raw_output_contents[0]) == []  # y went to the region
            np.testing.assert_allclose(output(response, "total"), x.sum(axis=1), rtol=1e-6)
            written = np.frombuffer(client.get(out_ptr + 8, 32), np.float32)
            np.testing.assert_array_equal(written.reshape(2, 4), 2 * x)
            error = await _status(stub.ModelInfer(_shm_infer("in", 32), metadata=b))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            bad = register(name="bad", raw_handle=in_handle[:60], device_id=0, byte_size=32)
            error = await _status(stub.CudaSharedMemoryRegister(bad, metadata=a))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "64 bytes of a cudaIpcMemHandle_t, got 60" in error.details()
            wrong = register(name="bad", raw_handle=in_handle, device_id=1, byte_size=32)
            error = await _status(stub.CudaSharedMemoryRegister(wrong, metadata=a))
            assert "device_id 1 is not a CUDA device of this server" in error.details()
            await stub.CudaSharedMemoryUnregister(
                pb.CudaSharedMemoryUnregisterRequest(name="in"), metadata=a
            )
            error = await _status(stub.ModelInfer(_shm_infer("in", 32), metadata=a))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            await stub.CudaSharedMemoryUnregister(
                pb.CudaSharedMemoryUnregisterRequest(), metadata=a
            )
            assert engine.regions.cuda.count() == 0
            assert server_cuda.open_ipc_mappings == 0
    finally:
        await server.stop(grace=None)
        client.free()
