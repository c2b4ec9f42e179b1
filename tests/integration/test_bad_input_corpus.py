"""A bad-input corpus against one real `sluice serve` (HTTP and gRPC), issue 12 "staying fixed":
Hypothesis-generated JSON, binary-extension and gRPC requests, plus the explicit cases of the
issue. No answer may be a 5xx (or INTERNAL / UNKNOWN over gRPC), the server must answer its
health check after every example, and it must still be running at the end. The counts (inputs
tried, status histogram) are printed at the end of the module (`pytest -s` shows them)."""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.demo import write_demo_repository
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.http.binary import HEADER_LENGTH
from tests.models import (
    DATATYPES,
    NUMPY_TYPES,
    identity_model,
    model_name,
    write_datatype_models,
    write_model,
)
from tests.servers import ServerProcess

SEEN: Counter[str] = Counter()
MODELS = ["demo", "cached", model_name("BYTES"), model_name("INT8"), model_name("BOOL"),
          model_name("FP16"), "nope"]  # fmt: skip
CORPUS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def corpus_repository(root: Path) -> Path:
    """The corpus's models: the demo, an identity model per datatype, and one with the cache."""
    repo = root / "repo"
    write_demo_repository(repo)
    write_datatype_models(repo)
    write_model(repo, "cached", identity_model("FP32"), "cache:\n  enabled: true\n")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("corpus")
    repo = corpus_repository(root)
    process = ServerProcess("--model-repository", str(repo), log_path=root / "server.log")
    process.start()
    yield process
    alive = process.process is not None and process.process.poll() is None
    tried = sum(count for key, count in SEEN.items() if not key.startswith("health"))
    print(f"\nbad-input corpus: {tried} inputs tried; statuses: {dict(sorted(SEEN.items()))}")
    log = (root / "server.log").read_text()
    assert "Exception in ASGI application" not in log
    assert "Unexpected [" not in log  # grpc's line for an exception escaping a handler
    process.stop()
    assert alive, "the server died during the corpus"


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc_url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def healthy(http: httpx.Client) -> None:
    response = http.get("/v2/health/live", timeout=2.0)
    SEEN[f"health {response.status_code}"] += 1
    assert response.status_code == 200


def post(http: httpx.Client, model: str, body: bytes, headers: Any = None) -> httpx.Response:
    response = http.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    SEEN[f"http {response.status_code}"] += 1
    assert response.status_code < 500, response.text
    assert "error" in response.json() if response.status_code >= 400 else True
    healthy(http)
    return response


# -- strategies -------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
dims = st.one_of(
    st.integers(0, 70), st.sampled_from([2**31, 2**32, 2**60, 2**61, 2**62, 2**63 - 1]),
    st.integers(-5, -1),
)  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True),
)  # fmt: skip
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                          max_size=4), max_leaves=20
)  # fmt: skip
shapes = st.one_of(st.lists(dims, max_size=4), st.lists(st.integers(1, 2), min_size=60,
                                                        max_size=70), json_values)  # fmt: skip
datatypes = st.one_of(
    st.sampled_from(DATATYPES), st.sampled_from(["FLOAT", "", "fp32"]), json_values
)
parameters = st.one_of(
    st.dictionaries(
        st.sampled_from(["shared_memory_region", "binary_data_size", "binary_data", "priority",
                         "timeout", "cache", "classification", "tag", "binary_data_output"]),
        json_values, max_size=3,
    ),
    json_values,
)  # fmt: skip
data = st.one_of(
    st.lists(st.floats(-1e3, 1e3) | st.integers(-300, 300), max_size=40),
    st.lists(st.lists(st.integers(0, 1), min_size=4, max_size=4), max_size=10),
    st.lists(st.text(max_size=4), max_size=10), json_values,
)  # fmt: skip
names = st.sampled_from(["x", "INPUT0", "y", ""]) | st.text(max_size=4)


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    fields = {"name": names, "datatype": datatypes, "shape": shapes, "data": data,
              "parameters": parameters}  # fmt: skip
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), min_size=2))
    return {key: draw(fields[key]) for key in sorted(chosen)}


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": draw(st.lists(tensors(), max_size=3) | json_values)}
    if draw(st.booleans()):
        body["parameters"] = draw(parameters)
    if draw(st.booleans()):
        body["outputs"] = draw(st.lists(st.fixed_dictionaries({"name": names},
                                                              optional={"parameters": parameters}))
                               | json_values)  # fmt: skip
    if draw(st.booleans()):
        body["id"] = draw(scalars)
    return body


TIMED_US = 60_000_000
"""A valid `timeout` under this many µs may pass or not by how fast the host is at that moment:
a 504 then says the host was slow, not that the request was mishandled (and two servers compared
answer for answer would differ by timing, not by what they are). The corpus's requests carry 0
(none) instead; an invalid timeout is refused alike, whatever the timing, and stays."""


def untimed(body: Any) -> Any:
    """`body` (a JSON request) with a valid timeout that could pass set to none."""
    parameters = body.get("parameters") if isinstance(body, dict) else None
    if isinstance(parameters, dict):
        value = parameters.get("timeout")
        if type(value) is int and 0 < value < TIMED_US:
            parameters["timeout"] = 0
    return body


def untimed_message(message: Any) -> Any:
    """The same for a gRPC ModelInferRequest."""
    if "timeout" in message.parameters:
        parameter = message.parameters["timeout"]
        kind = parameter.WhichOneof("parameter_choice")
        if kind in ("int64_param", "uint64_param") and 0 < getattr(parameter, kind) < TIMED_US:
            setattr(parameter, kind, 0)
    return message


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN, Infinity and big ints: all a server must refuse


# Requests one mistake (or none) away from valid, so the corpus reaches decoding, the engine,
# the cache and the encoders too: each model's input name, datatype and row width.
MODEL_INPUTS = {"demo": ("x", "FP32", 16), "cached": ("INPUT0", "FP32", 4)} | {
    model_name(t): ("INPUT0", t, 4) for t in ("BYTES", "INT8", "BOOL", "FP16")
}
VALUES = {
    # Mostly values that fit; sometimes one that does not (overflow, a bool, the wrong kind).
    "FP32": st.floats(-1e6, 1e6) | st.floats(-1e39, 1e39) | st.integers(-(2**64), 2**64),
    "FP16": st.floats(-6e4, 6e4, width=16) | st.floats(-7e4, 7e4) | st.integers(-(2**17), 2**17),
    "INT8": st.integers(-128, 127) | st.integers(-200, 200) | st.booleans(),
    "BOOL": st.booleans() | st.booleans() | st.integers(0, 1),
    "BYTES": st.text(max_size=5) | st.text(max_size=5) | st.integers(0, 9),
}


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, tuple[int, ...]]:
    model = draw(st.sampled_from(sorted(MODEL_INPUTS)))
    name, datatype, width = MODEL_INPUTS[model]
    if draw(st.integers(0, 9)) == 0:
        datatype = draw(st.sampled_from(DATATYPES))
    rows = draw(st.integers(1, 3) | st.integers(1, 3) | st.integers(0, 70))
    shape = (rows, width + draw(st.sampled_from([0] * 8 + [1, -1])))
    count = max(0, math.prod(shape) + draw(st.sampled_from([0] * 8 + [1, -1])))
    values = VALUES.get(datatype, VALUES["FP32"])
    tensor = {"name": name, "datatype": datatype, "shape": list(shape),
              "data": draw(st.lists(values, min_size=count, max_size=count))}  # fmt: skip
    body: dict[str, Any] = {"inputs": [tensor]}
    if draw(st.booleans()):
        keys = st.sampled_from(["priority", "timeout", "cache", "tag", "binary_data_output"])
        body["parameters"] = draw(st.dictionaries(keys, scalars, max_size=2))
    return model, body, datatype, shape


def raw_tensor(datatype: str, shape: tuple[int, ...], seed: bytes) -> bytes:
    """Tensor bytes in the binary layout, from arbitrary bytes (BOOL kept to 0 and 1)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return b"".join(len(seed[:i]).to_bytes(4, "little") + seed[:i] for i in range(count))
    size = count * max(1, {"BOOL": 1}.get(datatype, NUMPY_TYPES[datatype]().itemsize))
    data = (seed * (size // max(len(seed), 1) + 1))[:size] if seed else bytes(size)
    return bytes(b & 1 for b in data) if datatype == "BOOL" else data


# -- HTTP JSON --------------------------------------------------------------------------------


@CORPUS
@given(case=near_valid())
def test_near_valid_json_requests(
    http: httpx.Client, case: tuple[str, dict[str, Any], str, tuple[int, ...]]
) -> None:
    model, body, _, _ = case
    post(http, model, dumps(untimed(body)))


@CORPUS
@given(model=st.sampled_from(MODELS), body=requests(), cut=st.none() | st.integers(0, 400))
def test_json_requests(
    http: httpx.Client, model: str, body: dict[str, Any], cut: int | None
) -> None:
    raw = dumps(untimed(body))
    post(http, model, raw if cut is None else raw[:cut])


@CORPUS
@given(model=st.sampled_from(MODELS), raw=st.binary(max_size=200) | json_values.map(dumps))
def test_arbitrary_bodies(http: httpx.Client, model: str, raw: bytes) -> None:
    post(http, model, raw)


# -- HTTP binary extension --------------------------------------------------------------------


@CORPUS
@given(
    model=st.sampled_from(MODELS),
    body=requests(),
    sizes=st.lists(st.integers(-2, 80) | st.sampled_from([2**40, 2**63]) | json_values, max_size=3),
    tail=st.binary(max_size=120),
    length=st.none() | st.integers(-3, 300).map(str) | st.sampled_from(["+5", "1_0", "x", ""]),
)
def test_binary_requests(
    http: httpx.Client, model: str, body: dict[str, Any], sizes: list[Any], tail: bytes,
    length: str | None,
) -> None:  # fmt: skip
    inputs = body["inputs"] if isinstance(body["inputs"], list) else []
    for tensor, size in zip([t for t in inputs if isinstance(t, dict)], sizes, strict=False):
        tensor.pop("data", None)
        tensor["parameters"] = {"binary_data_size": size}
    header = dumps(untimed(body))
    headers = {HEADER_LENGTH: str(len(header)) if length is None else length}
    post(http, model, header + tail, headers)


@CORPUS
@given(case=near_valid(), seed=st.binary(max_size=24), extra=st.sampled_from([0, 0, 1, -1]),
       binary_out=st.booleans())  # fmt: skip
def test_near_valid_binary_requests(
    http: httpx.Client, case: tuple[str, dict[str, Any], str, tuple[int, ...]], seed: bytes,
    extra: int, binary_out: bool,
) -> None:  # fmt: skip
    model, body, datatype, shape = case
    tensor = body["inputs"][0]
    data = raw_tensor(datatype, shape, seed)
    data = data[:extra] if extra < 0 else data + bytes(extra)
    del tensor["data"]
    tensor["parameters"] = {"binary_data_size": len(data)}
    body["parameters"] = {"binary_data_output": binary_out}
    header = dumps(body)
    post(http, model, header + data, {HEADER_LENGTH: str(len(header))})


# -- gRPC -------------------------------------------------------------------------------------

GRPC_BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
contents = {
    "bool_contents": st.lists(st.booleans(), max_size=20),
    "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    "int64_contents": st.lists(INT64, max_size=20),
    "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=20),
    "fp32_contents": st.lists(st.floats(width=32), max_size=20),
    "fp64_contents": st.lists(st.floats(), max_size=20),
    "bytes_contents": st.lists(st.binary(max_size=6), max_size=20),
}


@st.composite
def grpc_requests(draw: st.DrawFn) -> Any:
    message = pb.ModelInferRequest(model_name=draw(st.sampled_from(MODELS)),
                                   id=draw(st.text(max_size=4)))  # fmt: skip
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(
            name=draw(names), datatype=draw(st.sampled_from([*DATATYPES, "FLOAT", ""])),
            shape=draw(st.lists(dims | st.integers(-(2**63), -1), max_size=4)),
        )  # fmt: skip
        for key in draw(st.lists(st.sampled_from(["shared_memory_region", "priority", "x"]),
                                 max_size=2)):  # fmt: skip
            tensor.parameters[key].int64_param = draw(INT64)
        if raw:
            message.raw_input_contents.append(draw(st.binary(max_size=80)))
        else:
            field = draw(st.sampled_from(sorted(contents)))
            getattr(tensor.contents, field).extend(draw(contents[field]))
    if draw(st.booleans()):
        message.raw_input_contents.append(draw(st.binary(max_size=16)))
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "cache", "tag"]), max_size=3)):
        choice = draw(st.sampled_from(["bool_param", "int64_param", "string_param",
                                       "double_param", "uint64_param"]))  # fmt: skip
        value = {"bool_param": st.booleans(), "int64_param": INT64,
                 "string_param": st.text(max_size=4), "double_param": st.floats(),
                 "uint64_param": st.integers(0, 2**64 - 1)}[choice]  # fmt: skip
        setattr(message.parameters[key], choice, draw(value))
    for name in draw(st.lists(names, max_size=2)):
        message.outputs.add(name=name)
    return message


@CORPUS
@given(message=grpc_requests())
def test_grpc_requests(http: httpx.Client, stub: Any, message: Any) -> None:
    code, details = grpc.StatusCode.OK, ""
    try:
        stub.ModelInfer(untimed_message(message), timeout=30)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    SEEN[f"grpc {code.name}"] += 1
    assert code not in GRPC_BAD, details
    healthy(http)


@CORPUS
@given(case=near_valid(), seed=st.binary(max_size=24), extra=st.sampled_from([0, 0, 1, -1]))
def test_near_valid_grpc_requests(
    http: httpx.Client, stub: Any, case: tuple[str, dict[str, Any], str, tuple[int, ...]],
    seed: bytes, extra: int,
) -> None:  # fmt: skip
    model, body, datatype, shape = case
    tensor = body["inputs"][0]
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name=tensor["name"], datatype=datatype, shape=list(shape))
    data = raw_tensor(datatype, shape, seed)
    message.raw_input_contents.append(data[:extra] if extra < 0 else data + bytes(extra))
    code, details = grpc.StatusCode.OK, ""
    try:
        stub.ModelInfer(message, timeout=30)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    SEEN[f"grpc {code.name}"] += 1
    assert code not in GRPC_BAD, details
    healthy(http)


# -- gRPC raw bytes (issue 38): any method, any bytes -------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
REPOSITORY_CHANGES = {"RepositoryModelLoad", "RepositoryModelUnload"}


def raw_grpc(channel: grpc.Channel, method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """`raw` sent unparsed as the request message of `method` (a stream: its one message)."""
    path = f"/{SERVICE.full_name}/{method}"
    try:
        if SERVICE.methods_by_name[method].client_streaming:
            list(channel.stream_stream(path)(iter([raw]), timeout=30))
        else:
            channel.unary_unary(path)(raw, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def parses(method: str, raw: bytes) -> bool:
    message = getattr(pb, SERVICE.methods_by_name[method].input_type.name)
    try:
        message.FromString(raw)
    except DecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_url) as channel:
        yield channel


@CORPUS
@given(method=st.sampled_from(sorted(SERVICE.methods_by_name)), raw=st.binary(max_size=200))
def test_grpc_raw_bytes(http: httpx.Client, channel: grpc.Channel, method: str, raw: bytes) -> None:
    valid = parses(method, raw)
    assume(not (valid and method in REPOSITORY_CHANGES))  # would unload the corpus's models
    code, details = raw_grpc(channel, method, raw)
    SEEN[f"grpc raw {code.name}"] += 1
    assert code not in GRPC_BAD, details
    if not valid:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"gRPC {method}: the request message could not be parsed")
    healthy(http)


def test_grpc_garbage_is_invalid_argument_with_bounded_logging(
    server: ServerProcess, http: httpx.Client, channel: grpc.Channel
) -> None:
    """15 calls of each kind log one line per method (grpc had logged a traceback per call)."""
    assert server.log_path is not None
    start = len(server.log_path.read_text())
    methods = ["ModelInfer", "ModelMetadata", "RepositoryModelLoad", "ModelStreamInfer"]
    for method in methods:
        for _ in range(15):
            code, details = raw_grpc(channel, method, b"\xff\xff\xff")
            SEEN[f"grpc raw {code.name}"] += 1
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert details.startswith(f"gRPC {method}: the request message could not be parsed")
    healthy(http)
    logged = server.log_path.read_text()
    assert logged.count("could not be parsed") >= 1  # here, or by the corpus above
    assert logged[start:].count("could not be parsed") <= len(methods)
    assert "Traceback" not in logged[start:]


# -- the explicit cases of issue 12 -----------------------------------------------------------


def x_tensor(**fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16, **fields}


def test_explicit_http_cases(http: httpx.Client) -> None:
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    cases: list[tuple[bytes, dict[str, str], int]] = [
        (dumps({"inputs": [x_tensor(shape=[0, 2**61], data=[])]}), {}, 400),
        (dumps({"inputs": [x_tensor()], "parameters": {"tag": deep}}), {}, 400),
        (dumps({"inputs": [x_tensor(parameters={"shared_memory_region": "r"})]}), {}, 400),
        (gzip.compress(dumps({"inputs": [x_tensor()]})) + b"junk", {"content-encoding": "gzip"},
         400),
        (dumps({"inputs": [x_tensor()]}), {HEADER_LENGTH: "+1"}, 400),
        (gzip.compress(b" " * (81 * 1024 * 1024)), {"content-encoding": "gzip"}, 413),
    ]  # fmt: skip
    for raw, headers, status in cases:
        assert post(http, "demo", raw, headers).status_code == status
    binary_header = dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**61],
                                       "parameters": {"binary_data_size": 0}}]})  # fmt: skip
    response = post(http, "demo", binary_header, {HEADER_LENGTH: str(len(binary_header))})
    assert response.status_code == 400
    twice = [("x-api-key", "a"), ("x-api-key", "b")]
    assert post(http, "demo", dumps({"inputs": [x_tensor()]}), twice).status_code == 400
    big = dumps({"inputs": [x_tensor(shape=[200_000, 16], data=[0] * 3_200_000)]})
    response = post(http, "demo", big)
    assert response.json()["error"] == (
        "batch size 200000 exceeds the maximum of 64 for model 'demo' version 1"
    )
    assert (
        post(
            http,
            "cached",
            dumps(
                {
                    "inputs": [
                        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}
                    ],
                    "parameters": {"t": [[[1]]]},
                }
            ),
        ).status_code
        == 200
    )


def test_explicit_grpc_cases(http: httpx.Client, stub: Any) -> None:
    for raw in (False, True):
        message = pb.ModelInferRequest(model_name="demo")
        message.inputs.add(name="x", datatype="FP32", shape=[0, 2**61])
        if raw:
            message.raw_input_contents.append(b"")
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(message, timeout=30)
        SEEN[f"grpc {caught.value.code().name}"] += 1
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shape [0, 2305843009213693952]" in caught.value.details()
        healthy(http)
