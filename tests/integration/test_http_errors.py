"""Bad input against a real `sluice serve` (issue 2, part 7): every case gets the right 4xx and
a JSON `{"error": ...}` naming the problem; never a 500, a hang, a crash or a file access."""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from engine.demo import write_demo_repository
from server.http import binary
from tests.models import (
    add_sub_model,
    fixed_shape_model,
    identity_model,
    model_name,
    write_datatype_models,
    write_model,
)
from tests.redis_process import free_port
from tests.servers import ServerProcess

DEMO = "model 'demo' version 1"
ROW = [0.5] * 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("errors")
    repo = root / "repo"
    write_demo_repository(repo)
    write_datatype_models(repo)
    write_model(repo, "add_sub", add_sub_model(), "max_batch_size: 8\n")
    write_model(repo, "fixed", fixed_shape_model("FP32", (2, 3)))
    write_model(repo, "cached", identity_model("FP32"), "cache:\n  enabled: true\n")
    # A loadable model just outside the repository: no URL may ever reach it.
    write_model(root, "secret", identity_model("FP32"))
    process = ServerProcess("--model-repository", str(repo), log_path=root / "server.log",
                            grpc=False)  # fmt: skip
    process.start()
    yield process
    process.stop()


def x_input(rows: int = 1, **fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [rows, 16], "data": ROW * rows, **fields}


def post(server: ServerProcess, path: str, content: bytes | dict[str, Any]) -> httpx.Response:
    raw = content if isinstance(content, bytes) else orjson.dumps(content)
    return httpx.post(f"{server.url}{path}", content=raw, timeout=10,
                      headers={"content-type": "application/json"})  # fmt: skip


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    assert isinstance(body["error"], str)
    return str(body["error"])


def demo_error(server: ServerProcess, payload: bytes | dict[str, Any], status: int = 400) -> str:
    return error_of(post(server, "/v2/models/demo/infer", payload), status)


def raw_request(
    server: ServerProcess, method: str, path: str, body: bytes = b""
) -> tuple[int, Any]:
    """A request whose path is sent byte for byte (httpx would normalise `..` segments)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        connection.request(method, path, body=body or None,
                           headers={"content-type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        assert response.getheader("content-type", "").startswith("application/json")
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


# -- the body ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"inputs": [', "JSON"),
        (b"{'inputs': []}", "JSON"),
        (b'{"inputs": [{"name": "x", "data": [NaN]}]}', "JSON"),
        (b'{"inputs": "\xff"}', "UTF-8"),
        (b"[" * 2000 + b"]" * 2000, "depth limit"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "request body is empty"),
    ],
)
def test_unparseable_body(server: ServerProcess, raw: bytes, fragment: str) -> None:
    message = demo_error(server, raw)
    assert fragment in message
    if raw.startswith(b"{"):
        assert re.search(r"malformed JSON|not valid JSON", message)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({}, "request: missing field 'inputs'"),
        ({"inputs": {"x": ROW}}, "'inputs' must be"),
        ({"inputs": []}, "request: 'inputs' is empty"),
        ({"inputs": [x_input(data=["0.5"] * 16)]}, "input 'x': data holds text; datatype FP32"),
        ({"inputs": [x_input(data=[True] * 16)]}, "input 'x': data holds"),
        ({"inputs": [x_input(data=[None] * 16)]}, "input 'x'"),
        ({"inputs": [x_input(datatype="FLOAT")]}, "unknown datatype 'FLOAT'; allowed: BOOL"),
        ({"inputs": [x_input(shape=[1, -16])]}, "input 'x': shape must be a list of non-negative"),
        ({"inputs": [x_input(shape="1,16")]}, "input 'x': field 'shape' must be list"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16]}]},
         "input 'x': missing field 'data'"),
        ({"inputs": [x_input(), x_input()]}, "input 'x' is given twice"),
        ({"inputs": [x_input()], "id": 7}, "request: 'id' must be a string, got 7"),
        ({"inputs": [x_input()], "parameters": ["priority"]}, "'parameters' must be an object"),
        ({"inputs": [x_input()], "parameters": {"timeout": -5}},
         "parameter 'timeout' must be a non-negative integer, got -5"),
        ({"inputs": [x_input()], "parameters": {"priority": 3}},
         f"priority 3 is out of range for {DEMO}"),
        ({"inputs": [x_input()], "outputs": [{"name": "logits"}]},
         f"unknown output 'logits' requested from {DEMO}; it has: probabilities"),
    ],
)  # fmt: skip
def test_wrong_request_structure(
    server: ServerProcess, payload: dict[str, Any], fragment: str
) -> None:
    assert fragment in demo_error(server, payload)


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("INT32", [1.5, 2, 3, 4], "datatype INT32 needs integers"),
        ("INT64", [True, False, True, False], "datatype INT64 needs integers"),
        ("INT8", [1, 2, 3, 128], "value 128 is out of range for INT8 (-128 to 127)"),
        ("UINT8", [-1, 2, 3, 4], "value -1 is out of range for UINT8 (0 to 255)"),
        ("BOOL", [0, 1, 0, 1], "datatype BOOL needs booleans"),
        ("BYTES", [1, 2, 3, 4], "BYTES data must be strings"),
    ],
)
def test_wrong_json_types_per_datatype(
    server: ServerProcess, datatype: str, data: list[Any], fragment: str
) -> None:
    payload = {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": [1, 4], "data": data}]}
    message = error_of(post(server, f"/v2/models/{model_name(datatype)}/infer", payload), 400)
    assert message.startswith("input 'INPUT0'")
    assert fragment in message


# -- the request against the model -------------------------------------------------------------


def test_unknown_model(server: ServerProcess) -> None:
    message = error_of(post(server, "/v2/models/nope/infer", {"inputs": [x_input()]}), 404)
    assert message.startswith("unknown model 'nope'; available: ")
    assert "demo" in message
    assert error_of(httpx.get(f"{server.url}/v2/models/nope"), 404) == message
    assert error_of(httpx.get(f"{server.url}/v2/models/nope/ready"), 404) == message


def test_model_outside_the_repository_is_unknown(server: ServerProcess) -> None:
    assert "unknown model 'secret'" in error_of(httpx.get(f"{server.url}/v2/models/secret"), 404)


@pytest.mark.parametrize("version", ["9", "01", "latest"])
def test_unknown_version(server: ServerProcess, version: str) -> None:
    path = f"/v2/models/demo/versions/{version}"
    expected = f"unknown version '{version}' of model 'demo'; available: 1"
    assert error_of(post(server, f"{path}/infer", {"inputs": [x_input()]}), 404) == expected
    assert error_of(httpx.get(f"{server.url}{path}"), 404) == expected
    assert error_of(httpx.get(f"{server.url}{path}/ready"), 404) == expected


def test_missing_input(server: ServerProcess) -> None:
    payload = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    message = error_of(post(server, "/v2/models/add_sub/infer", payload), 400)
    assert message == (
        "missing input 'INPUT1' for model 'add_sub' version 1; it takes: INPUT0, INPUT1"
    )


def test_unexpected_input(server: ServerProcess) -> None:
    payload = {"inputs": [x_input(), {**x_input(), "name": "y"}]}
    assert demo_error(server, payload) == f"unexpected input 'y' for {DEMO}; it takes: x"


def test_wrong_datatype(server: ServerProcess) -> None:
    message = demo_error(server, {"inputs": [x_input(datatype="FP64")]})
    assert message == f"input 'x' has datatype FP64; {DEMO} expects FP32"


def test_shape_disagrees_with_data_length(server: ServerProcess) -> None:
    message = demo_error(server, {"inputs": [x_input(data=ROW[:15])]})
    assert message == "input 'x': shape [1, 16] needs 16 values, data has 15"


@pytest.mark.parametrize(
    ("shape", "shown"), [([1, 15], "[1,15]"), ([16], "[16]"), ([1, 4, 4], "[1,4,4]")]
)
def test_shape_the_model_cannot_take(server: ServerProcess, shape: list[int], shown: str) -> None:
    data = [0.5] * math.prod(shape)
    message = demo_error(server, {"inputs": [x_input(shape=shape, data=data)]})
    assert message == f"input 'x' has shape {shown}; {DEMO} expects [-1,16]"


def test_fixed_shape_model_refuses_a_batch_axis(server: ServerProcess) -> None:
    payload = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2, 3],
                           "data": [0] * 6}]}  # fmt: skip
    message = error_of(post(server, "/v2/models/fixed/infer", payload), 400)
    assert message == "input 'INPUT0' has shape [1,2,3]; model 'fixed' version 1 expects [2,3]"


def test_batch_over_max_batch_size(server: ServerProcess) -> None:
    message = demo_error(server, {"inputs": [x_input(rows=65)]})
    assert message == f"batch size 65 exceeds the maximum of 64 for {DEMO}"


def test_batch_sizes_that_disagree(server: ServerProcess) -> None:
    payload = {"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [2, 4], "data": [1] * 8},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4},
    ]}  # fmt: skip
    message = error_of(post(server, "/v2/models/add_sub/infer", payload), 400)
    assert "input 'INPUT1' has batch size 1 but other inputs have 2" in message


@pytest.mark.parametrize(
    "shape",
    [[1] * 65, [0, 2**70], [0, 2**62, 2**62], [0, 2**61]],
    ids=["65-dims", "dim-2^70", "size-overflow", "zero-size-2^61"],
)
def test_shapes_no_array_can_have(server: ServerProcess, shape: list[int]) -> None:
    data = [0.5] if len(shape) == 65 else []
    # The standard library encoder: orjson refuses ints beyond 64 bits.
    payload = json.dumps({"inputs": [x_input(shape=shape, data=data)]}).encode()
    message = demo_error(server, payload)
    assert message.startswith("input 'x': shape")


def binary_post(
    server: ServerProcess, header: dict[str, Any], data: bytes = b"", **headers: str
) -> httpx.Response:
    raw = orjson.dumps(header)
    return httpx.post(f"{server.url}/v2/models/demo/infer", content=raw + data, timeout=10,
                      headers={binary.HEADER_LENGTH: str(len(raw)), **headers})  # fmt: skip


def test_zero_sized_shape_too_large_for_numpy_over_binary(server: ServerProcess) -> None:
    tensor = {"name": "x", "datatype": "FP32", "shape": [0, 2**61],
              "parameters": {"binary_data_size": 0}}  # fmt: skip
    message = error_of(binary_post(server, {"inputs": [tensor]}), 400)
    assert message.startswith("input 'x': shape [0, 2305843009213693952] is too large")


def test_parameter_nested_too_deep_is_400_on_a_cached_model(server: ServerProcess) -> None:
    value: Any = 1
    for _ in range(600):
        value = [value]
    payload = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}],
               "parameters": {"tag": value}}  # fmt: skip
    raw = json.dumps(payload).encode()  # orjson refuses to write this deep
    message = error_of(post(server, "/v2/models/cached/infer", raw), 400)
    assert message == "request: parameter 'tag' is nested deeper than 32 levels"


def test_shared_memory_input_with_data_is_400(server: ServerProcess) -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    message = demo_error(server, {"inputs": [x_input(parameters=params)]})
    assert message == "input 'x' names a shared memory region and sends data too; send one"


UINT64_MAX = 2**64 - 1
PAST_64_BITS = [
    ({"parameters": {"timeout": 2**64}}, "parameter 'timeout'", "2^64 or more"),
    ({"parameters": {"priority": 2**70}}, "parameter 'priority'", "2^64 or more"),
    ({"parameters": {"timeout": -(2**64)}}, "parameter 'timeout'", "below -2^63"),
    ({"binary_data_size": 2**70}, "input 'x': binary_data_size", "2^64 or more"),
]


def request_with(extra: dict[str, Any], binary_extension: bool) -> tuple[bytes, dict[str, str]]:
    """A demo request carrying `extra`: request parameters, or the input's binary_data_size;
    as JSON, or in the binary extension's header (x sent as binary data)."""
    x = np.full((1, 16), 0.5, np.float32)
    tensor: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": [1, 16]}
    size = extra.get("binary_data_size", x.nbytes if binary_extension else None)
    if size is not None:
        tensor["parameters"] = {"binary_data_size": size}
    if not binary_extension:
        tensor["data"] = ROW
    payload = {"inputs": [tensor], "parameters": extra.get("parameters", {})}
    # The standard library encoder, as a client writes them: orjson refuses ints past 64 bits.
    header = json.dumps(payload).encode()
    if not binary_extension:
        return header, {"content-type": "application/json"}
    return header + x.tobytes(), {binary.HEADER_LENGTH: str(len(header))}


@pytest.mark.parametrize("binary_extension", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(("extra", "what", "shown"), PAST_64_BITS)
def test_integer_parameters_past_64_bits_are_out_of_range(
    server: ServerProcess, binary_extension: bool, extra: dict[str, Any], what: str, shown: str
) -> None:
    """The parser reads an integer past 64 bits as a double: the message showed its digits
    (1.8446744073709552e+19, which reads as less than the largest uint64) as a wrong kind."""
    content, headers = request_with(extra, binary_extension)
    response = httpx.post(f"{server.url}/v2/models/demo/infer", content=content, headers=headers)
    message = error_of(response, 400)
    assert message == f"{what} is out of range (0 to {UINT64_MAX}), got {shown}"


@pytest.mark.parametrize("binary_extension", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(("dim", "shown"), [(2**70, "2^64 or more"), (-(2**64), "below -2^63")])
def test_a_shape_dimension_past_64_bits_is_out_of_range(
    server: ServerProcess, binary_extension: bool, dim: int, shown: str
) -> None:
    """It was 'shape must be a list of non-negative integers, got [0, 1.1805916207174113e+21]'."""
    tensor: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": [0, dim]}
    if binary_extension:
        tensor["parameters"] = {"binary_data_size": 0}
    else:
        tensor["data"] = []
    header = json.dumps({"inputs": [tensor]}).encode()  # orjson cannot write it
    headers = {binary.HEADER_LENGTH: str(len(header))} if binary_extension else {}
    response = httpx.post(f"{server.url}/v2/models/demo/infer", content=header,
                          headers={"content-type": "application/json", **headers})  # fmt: skip
    message = error_of(response, 400)
    assert message == f"input 'x': shape[1] is out of range (0 to {2**60 - 1}), got {shown}"


@pytest.mark.parametrize("binary_extension", [False, True], ids=["json", "binary"])
def test_integer_parameters_at_the_uint64_bound(
    server: ServerProcess, binary_extension: bool
) -> None:
    """The largest uint64 fits the parameters' type (Triton's, gRPC's uint64_param): a timeout
    of it serves, a priority of it is named exactly against the model's levels."""
    url = f"{server.url}/v2/models/demo/infer"
    content, headers = request_with({"parameters": {"timeout": UINT64_MAX}}, binary_extension)
    assert httpx.post(url, content=content, headers=headers).status_code == 200
    content, headers = request_with({"parameters": {"priority": UINT64_MAX}}, binary_extension)
    message = error_of(httpx.post(url, content=content, headers=headers), 400)
    assert message.startswith(f"priority {UINT64_MAX} is out of range for {DEMO}")


def test_two_api_key_headers_are_400(server: ServerProcess) -> None:
    body = orjson.dumps({"inputs": [x_input()]})
    headers = [("x-api-key", "a"), ("x-api-key", "b"), ("content-type", "application/json")]
    response = httpx.post(f"{server.url}/v2/models/demo/infer", content=body, headers=headers)
    assert error_of(response, 400) == "header 'x-api-key' is sent 2 times; send it once"


@pytest.mark.parametrize(
    "path", ["/v2/models/demo", "/v2/models/demo/ready", "/v2/tenants/self/usage"]
)
def test_two_api_key_headers_are_400_on_every_route(server: ServerProcess, path: str) -> None:
    headers = [("x-api-key", "a"), ("x-api-key", "b")]
    response = httpx.get(f"{server.url}{path}", headers=headers)
    assert error_of(response, 400) == "header 'x-api-key' is sent 2 times; send it once"


@pytest.mark.parametrize("length", ["+40", "4_0"])
def test_header_length_takes_only_digits(server: ServerProcess, length: str) -> None:
    raw = orjson.dumps({"inputs": [x_input()]})
    length = length.replace("40", str(len(raw)))
    response = httpx.post(f"{server.url}/v2/models/demo/infer", content=raw,
                          headers=[(binary.HEADER_LENGTH.encode(), length.encode())])  # fmt: skip
    message = error_of(response, 400)
    assert message == f"{binary.HEADER_LENGTH} is {length!r}; expected a whole number of bytes"


# -- URLs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/..%2F..%2Fetc/infer",
        "/v2/models/..%2Fsecret/infer",
        "/v2/models/../secret/infer",
        "/v2/models/%2E%2E/infer",
        "/v2/models/../infer",
        "/v2/models/%2Fetc%2Fpasswd/infer",
        "/v2/models/demo/versions/..%2F..%2F1/infer",
        "/v2/models/demo/versions/%2E%2E/infer",
        "/v2/models/a%20b/infer",
        "/v2/models/a%00b/infer",
        "/v2/models/.hidden/infer",
        "/v2/models/-rf/infer",
    ],
)
def test_path_traversal_names_never_reach_a_file(server: ServerProcess, path: str) -> None:
    body = orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                     "data": [1] * 4}]})  # fmt: skip
    status, answer = raw_request(server, "POST", path, body)
    assert status in (400, 404)
    assert isinstance(answer["error"], str)
    if status == 400:
        assert answer["error"].startswith(("invalid model name", "invalid version name"))
    metadata_status, _ = raw_request(server, "GET", path.removesuffix("/infer"))
    assert metadata_status in (400, 404)


def test_wrong_method_is_json(server: ServerProcess) -> None:
    wrong = httpx.get(f"{server.url}/v2/models/demo/infer")
    assert error_of(wrong, 405) == "Method Not Allowed"
    assert wrong.headers["allow"] == "POST"
    assert wrong.headers["x-request-id"]
    assert error_of(httpx.get(f"{server.url}/v2/nothing/here"), 404) == "Not Found"
    posted = httpx.post(f"{server.url}/v2/health/ready")  # RFC 9110: a 405 says what is allowed
    assert error_of(posted, 405) == "Method Not Allowed"
    assert set(posted.headers["allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize(
    "path", ["/v2/health/live", "/v2/health/ready", "/v2/models/demo", "/v2/models/demo/ready"]
)
def test_health_and_metadata_answer_head(server: ServerProcess, path: str) -> None:
    head = httpx.head(server.url + path)
    assert head.status_code == 200
    assert head.content == b""


# -- the server survives it all ---------------------------------------------------------------


def test_server_still_answers_after_the_bad_requests(server: ServerProcess) -> None:
    assert server.process is not None
    assert server.process.poll() is None
    response = post(server, "/v2/models/demo/infer", {"inputs": [x_input(rows=2)]})
    assert response.status_code == 200
    assert response.json()["outputs"][0]["shape"] == [2, 10]
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    assert server.log_path is not None
    # No request above may have escaped as an unhandled exception (a 500 with a traceback).
    assert "Exception in ASGI application" not in server.log_path.read_text()


# -- limits and exposure ----------------------------------------------------------------------


def test_body_over_the_limit_is_413(start_server: Any) -> None:
    small = start_server(env={"SLUICE_MAX_REQUEST_BYTES": "2048", "SLUICE_GRPC_ENABLED": "false"})
    big = orjson.dumps({"inputs": [x_input(rows=64)]})
    assert len(big) > 2048
    url = f"{small.url}/v2/models/demo/infer"
    declared = httpx.post(url, content=big, timeout=10)
    message = error_of(declared, 413)
    assert message == f"request body of {len(big)} bytes exceeds the limit of 2048 bytes"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while streaming
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    streamed = httpx.post(url, content=chunks(), timeout=10)
    assert "exceeds the limit of 2048 bytes" in error_of(streamed, 413)
    fits = httpx.post(url, content=orjson.dumps({"inputs": [x_input()]}), timeout=10)
    assert fits.status_code == 200
    # Expect: 100-continue, answered 413 before any 100: the client sends no body, so the
    # connection closes after the answer. It waited for the body (the client's next request
    # read as one) until the body timeout, 60 s.
    with socket.create_connection(("127.0.0.1", small.http_port), timeout=10) as client:
        client.sendall(
            b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/json\r\nContent-Length: 94371840\r\n\r\n"
        )
        answer = b""
        while chunk := client.recv(65536):  # until the server closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "server", "serve", "--http-port", str(free_port()),
            "--grpc-port", str(free_port()), *args]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "host"),
    [
        (["--host", "0.0.0.0"], {}, "0.0.0.0"),
        ([], {"SLUICE_HOST": "0.0.0.0"}, "0.0.0.0"),
        (["--host", "::"], {}, "::"),
    ],
    ids=["flag", "env", "ipv6-any"],
)
def test_non_loopback_without_keys_refuses_to_start(
    args: list[str], env: dict[str, str], host: str
) -> None:
    import os

    result = subprocess.run(
        serve_command(*args), env={**os.environ, **env}, capture_output=True, timeout=60,
        text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert re.search(rf"refusing to \w+ {re.escape(host)} with no API keys", result.stderr)
    assert "--allow-unauthenticated" in result.stderr
    assert "Traceback" not in result.stderr


def test_non_loopback_with_allow_unauthenticated_starts(start_server: Any, tmp_path: Path) -> None:
    exposed = start_server("--host", "0.0.0.0", "--allow-unauthenticated",
                           env={"SLUICE_GRPC_ENABLED": "false"})  # fmt: skip
    response = httpx.get(f"{exposed.url}/v2/health/ready")
    assert (response.status_code, response.json()) == (200, {"ready": True})
