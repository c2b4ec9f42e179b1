"""tritonclient (http and grpc, from PyPI, unchanged) against a real `sluice serve` process.

tritonclient.grpc registers the same `inference.*` protobuf names as sluice's own modules, so it
cannot be imported in the pytest process (other tests import sluice's). The gRPC calls run in a
child process instead: this file run as a script (`python test_tritonclient.py grpc HOST:PORT`)
makes every call and prints the results as JSON, which the tests below check.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

LOADED = ["add_sub", "strings", "types", "big"]
TYPES = ("BOOL", "INT8", "UINT64", "FP16", "FP64")


def write_repository(repo: Path) -> None:
    from tests.models import add_sub_model, identity_model, write_model

    batched = "max_batch_size: 8\ndynamic_batching:\n  max_queue_delay_s: 0.001\n"
    write_model(repo, "add_sub", add_sub_model(4), batched)
    write_model(repo, "spare", add_sub_model(4), batched)
    write_model(repo, "strings", identity_model("BYTES", ("batch",)), batched)
    write_model(repo, "big", identity_model("FP32", ("n",)), "max_batch_size: 0\n")
    for datatype in TYPES:
        write_model(repo, f"identity_{datatype.lower()}", identity_model(datatype), batched)


@pytest.fixture(scope="module")
def sluice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.servers import ServerProcess

    repo = tmp_path_factory.mktemp("repository")
    write_repository(repo)
    models = [*LOADED, *(f"identity_{t.lower()}" for t in TYPES)]
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    for name in models:
        args += ["--load-model", name]
    server = ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log")
    server.start(timeout_s=90)
    yield server
    server.stop()


# -- gRPC, in a child process ---------------------------------------------------------------------


def grpc_calls(url: str) -> dict[str, Any]:
    """Every tritonclient.grpc call the tests check; runs in the child process."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    out: dict[str, Any] = {}

    def error(call: Any) -> list[str]:
        try:
            call()
        except InferenceServerException as exc:
            return [str(exc.status()), str(exc.message())]
        return ["no error", ""]

    def add_sub_inputs(seed: int) -> tuple[list[Any], np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
        inputs = [
            grpcclient.InferInput("INPUT0", [3, 4], "FP32"),
            grpcclient.InferInput("INPUT1", [3, 4], "FP32"),
        ]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        return inputs, a, b

    out["live"], out["ready"] = client.is_server_live(), client.is_server_ready()
    out["model_ready"] = [client.is_model_ready("add_sub"), client.is_model_ready("nope")]
    out["server_metadata"] = client.get_server_metadata(as_json=True)
    out["model_metadata"] = client.get_model_metadata("add_sub", as_json=True)
    out["model_config"] = client.get_model_config("add_sub", as_json=True)

    inputs, a, b = add_sub_inputs(1)
    result = client.infer("add_sub", inputs, request_id="g-1")
    out["infer"] = {
        "id": result.get_response().id,
        "sum_ok": bool(np.array_equal(result.as_numpy("SUM"), a + b)),
        "diff_ok": bool(np.array_equal(result.as_numpy("DIFF"), a - b)),
        "outputs": [o.name for o in result.get_response().outputs],
    }
    only = client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("DIFF")])
    out["infer_one_output"] = [o.name for o in only.get_response().outputs]

    texts = np.array([b"hello", b"", "gr\u00fc\u00df".encode()], dtype=object)
    text_input = grpcclient.InferInput("INPUT0", [3], "BYTES")
    text_input.set_data_from_numpy(texts)
    echoed = client.infer("strings", [text_input]).as_numpy("OUTPUT0")
    out["bytes"] = [item.decode() for item in echoed]

    out["types"] = {}
    for datatype, dtype in (
        ("BOOL", np.bool_),
        ("INT8", np.int8),
        ("UINT64", np.uint64),
        ("FP16", np.float16),
        ("FP64", np.float64),
    ):
        data = (np.arange(8) % 3).astype(dtype).reshape(2, 4)
        tensor = grpcclient.InferInput("INPUT0", [2, 4], datatype)
        tensor.set_data_from_numpy(data)
        got = client.infer(f"identity_{datatype.lower()}", [tensor]).as_numpy("OUTPUT0")
        out["types"][datatype] = bool(got.dtype == dtype and np.array_equal(got, data))

    done: queue.Queue[Any] = queue.Queue()
    inputs, a, b = add_sub_inputs(2)
    client.async_infer("add_sub", inputs, lambda result, error: done.put((result, error)))
    result, failure = done.get(timeout=30)
    out["async_infer"] = failure is None and bool(np.array_equal(result.as_numpy("SUM"), a + b))

    async def aio() -> bool:
        async with grpcaio.InferenceServerClient(url) as aclient:
            inputs, a, b = add_sub_inputs(3)
            result = await aclient.infer("add_sub", inputs)
            return await aclient.is_server_ready() and bool(
                np.array_equal(result.as_numpy("DIFF"), a - b)
            )

    out["aio_infer"] = asyncio.run(aio())

    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)))
    streamed = {}
    for index in range(3):
        inputs, a, b = add_sub_inputs(10 + index)
        streamed[f"s{index}"] = a + b
        client.async_stream_infer("add_sub", inputs, request_id=f"s{index}")
    matched = 0
    for _ in range(3):
        result, failure = answers.get(timeout=30)
        rid = result.get_response().id
        matched += failure is None and bool(np.array_equal(result.as_numpy("SUM"), streamed[rid]))
    client.stop_stream()
    out["stream_matched"] = matched

    stats = client.get_inference_statistics("add_sub", as_json=True)
    out["statistics"] = stats["model_stats"][0]
    out["statistics_all"] = sorted(
        s["name"] for s in client.get_inference_statistics(as_json=True)["model_stats"]
    )

    def index() -> dict[str, str]:
        rows = client.get_model_repository_index(as_json=True)["models"]
        return {row["name"]: row.get("state", "") for row in rows}

    out["index_before"] = index()
    client.load_model("spare")
    out["spare_after_load"] = [client.is_model_ready("spare"), index()["spare"]]
    client.unload_model("spare")
    out["spare_after_unload"] = [client.is_model_ready("spare"), index()["spare"]]

    inputs, _, _ = add_sub_inputs(4)
    out["error_unknown_model"] = error(lambda: client.infer("nope", inputs))
    bad = grpcclient.InferInput("INPUT0", [3, 4], "FP32")
    bad.set_data_from_numpy(np.zeros((3, 4), np.float32))
    bad._raw_content = bytes(60)  # a buggy client: 60 bytes for a [3, 4] FP32 tensor
    out["error_raw_size"] = error(lambda: client.infer("add_sub", [bad, inputs[1]]))
    out["error_shape"] = error(lambda: client.get_model_metadata("add_sub", model_version="9"))

    huge = np.random.default_rng(5).random(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB
    tensor = grpcclient.InferInput("INPUT0", [huge.size], "FP32")
    tensor.set_data_from_numpy(huge)
    out["64MiB"] = bool(np.array_equal(client.infer("big", [tensor]).as_numpy("OUTPUT0"), huge))
    client.close()
    return out


@pytest.fixture(scope="module")
def grpc_results(sluice: Any) -> dict[str, Any]:
    child = subprocess.run(
        [sys.executable, __file__, "grpc", sluice.grpc_url],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.returncode == 0, f"{child.stderr[-3000:]}\nserver log:\n{sluice.logs()}"
    results: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def test_grpc_health_and_metadata(grpc_results: dict[str, Any]) -> None:
    assert grpc_results["live"] is True
    assert grpc_results["ready"] is True
    assert grpc_results["model_ready"] == [True, False]
    assert grpc_results["server_metadata"]["name"] == "sluice"
    assert "binary_tensor_data" in grpc_results["server_metadata"]["extensions"]
    meta = grpc_results["model_metadata"]
    assert meta["name"] == "add_sub"
    assert meta["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("INPUT0", "FP32", ["-1", "4"]),  # MessageToJson writes int64 as strings
        ("INPUT1", "FP32", ["-1", "4"]),
    ]


def test_grpc_model_config(grpc_results: dict[str, Any]) -> None:
    config = grpc_results["model_config"]["config"]
    assert config["name"] == "add_sub"
    assert config["max_batch_size"] == 8
    assert config["input"][0] == {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "1000"


def test_grpc_infer_raw_contents(grpc_results: dict[str, Any]) -> None:
    assert grpc_results["infer"] == {
        "id": "g-1",
        "sum_ok": True,
        "diff_ok": True,
        "outputs": ["SUM", "DIFF"],
    }
    assert grpc_results["infer_one_output"] == ["DIFF"]
    assert grpc_results["bytes"] == ["hello", "", "gr\u00fc\u00df"]
    assert grpc_results["types"] == dict.fromkeys(TYPES, True)
    assert grpc_results["64MiB"] is True


def test_grpc_async_aio_and_stream(grpc_results: dict[str, Any]) -> None:
    assert grpc_results["async_infer"] is True
    assert grpc_results["aio_infer"] is True
    assert grpc_results["stream_matched"] == 3


def test_grpc_statistics_and_repository(grpc_results: dict[str, Any]) -> None:
    stats = grpc_results["statistics"]
    assert stats["name"] == "add_sub"
    assert int(stats["inference_count"]) >= 3
    assert int(stats["inference_stats"]["success"]["count"]) >= 3
    assert "add_sub" in grpc_results["statistics_all"]
    assert grpc_results["index_before"]["add_sub"] == "READY"
    assert grpc_results["index_before"]["spare"] == "UNAVAILABLE"
    assert grpc_results["spare_after_load"] == [True, "READY"]
    assert grpc_results["spare_after_unload"] == [False, "UNAVAILABLE"]


def test_grpc_errors(grpc_results: dict[str, Any]) -> None:
    status, message = grpc_results["error_unknown_model"]
    assert status == "StatusCode.NOT_FOUND"
    assert "unknown model 'nope'" in message
    status, message = grpc_results["error_raw_size"]
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert "input 'INPUT0' has shape [3, 4] of FP32, which is 48 bytes; received 60" in message
    status, message = grpc_results["error_shape"]
    assert status == "StatusCode.NOT_FOUND"
    assert "version '9' of model 'add_sub'" in message


# -- HTTP, in this process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(sluice: Any) -> Iterator[Any]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{sluice.http_port}", concurrency=4)
    yield client
    client.close()


def _add_sub(binary: tuple[bool, bool], seed: int = 0) -> tuple[list[Any], np.ndarray, np.ndarray]:
    import tritonclient.http as httpclient

    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((2, 4)).astype(np.float32) for _ in range(2))
    inputs = [
        httpclient.InferInput("INPUT0", [2, 4], "FP32"),
        httpclient.InferInput("INPUT1", [2, 4], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a, binary_data=binary[0])
    inputs[1].set_data_from_numpy(b, binary_data=binary[1])
    return inputs, a, b


def test_http_health_and_metadata(http: Any) -> None:
    assert http.is_server_live() is True
    assert http.is_server_ready() is True
    assert http.is_model_ready("add_sub") is True
    assert http.get_server_metadata()["name"] == "sluice"
    meta = http.get_model_metadata("add_sub")
    assert [o["name"] for o in meta["outputs"]] == ["SUM", "DIFF"]
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}


def test_http_model_config(http: Any) -> None:
    for config in (http.get_model_config("add_sub"), http.get_model_config("add_sub", "1")):
        assert config["name"] == "add_sub"
        assert config["max_batch_size"] == 8
        assert config["input"][1] == {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000


@pytest.mark.parametrize(
    ("inputs_binary", "outputs_binary"),
    [((True, True), True), ((False, False), False), ((True, False), False), ((False, True), True)],
)
def test_http_infer_json_binary_and_mixed(
    http: Any, inputs_binary: tuple[bool, bool], outputs_binary: bool
) -> None:
    import tritonclient.http as httpclient

    inputs, a, b = _add_sub(inputs_binary)
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=outputs_binary) for n in ("SUM", "DIFF")
    ]
    result = http.infer("add_sub", inputs, outputs=outputs, request_id="h-1")
    np.testing.assert_allclose(result.as_numpy("SUM"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("DIFF"), a - b, rtol=1e-6)
    response = result.get_response()
    assert response["id"] == "h-1"
    for output in response["outputs"]:
        assert ("binary_data_size" in output.get("parameters", {})) is outputs_binary


def test_http_default_outputs_are_binary(http: Any) -> None:
    inputs, a, b = _add_sub((True, True))
    result = http.infer("add_sub", inputs)  # tritonclient then asks binary_data_output
    assert all(o["parameters"]["binary_data_size"] == 32 for o in result.get_response()["outputs"])
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)


def test_http_bytes_and_datatypes(http: Any) -> None:
    import tritonclient.http as httpclient

    texts = np.array([b"hello", b"", "gr\u00fc\u00df".encode()], dtype=object)
    for binary in (True, False):
        tensor = httpclient.InferInput("INPUT0", [3], "BYTES")
        tensor.set_data_from_numpy(texts, binary_data=binary)
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        got = http.infer("strings", [tensor], outputs=[output]).as_numpy("OUTPUT0")
        decoded = [x.decode() if isinstance(x, bytes) else x for x in got]
        assert decoded == ["hello", "", "gr\u00fc\u00df"], binary
    for datatype, dtype in (
        ("BOOL", np.bool_),
        ("INT8", np.int8),
        ("UINT64", np.uint64),
        ("FP16", np.float16),
        ("FP64", np.float64),
    ):
        data = (np.arange(8) % 3).astype(dtype).reshape(2, 4)
        tensor = httpclient.InferInput("INPUT0", [2, 4], datatype)
        tensor.set_data_from_numpy(data)
        got = http.infer(f"identity_{datatype.lower()}", [tensor]).as_numpy("OUTPUT0")
        assert got.dtype == dtype, datatype
        np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_http_compression(http: Any, algorithm: str) -> None:
    inputs, a, b = _add_sub((True, True), seed=3)
    result = http.infer(
        "add_sub",
        inputs,
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)


def test_http_async_infer(http: Any) -> None:
    pending = [
        (http.async_infer("add_sub", inputs), a, b)
        for inputs, a, b in (_add_sub((True, True), seed=s) for s in range(4))
    ]
    for request, a, b in pending:
        np.testing.assert_array_equal(request.get_result(timeout=30).as_numpy("SUM"), a + b)


async def test_http_aio_infer(sluice: Any) -> None:
    import tritonclient.http.aio as httpaio

    async with httpaio.InferenceServerClient(f"127.0.0.1:{sluice.http_port}") as client:
        assert await client.is_server_ready()
        inputs, a, b = _add_sub((True, False), seed=9)
        result = await client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)
        stats = await client.get_inference_statistics("add_sub")
        assert stats["model_stats"][0]["name"] == "add_sub"


def test_http_statistics(http: Any) -> None:
    _ = http.infer("add_sub", _add_sub((True, True))[0])
    everything = http.get_inference_statistics()["model_stats"]
    assert "add_sub" in {s["name"] for s in everything}
    (stats,) = http.get_inference_statistics("add_sub")["model_stats"]
    assert stats["version"] == "1"
    assert stats["inference_count"] >= 1
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["batch_stats"][0]["batch_size"] >= 1
    versioned = http.get_inference_statistics("add_sub", "1")["model_stats"]
    assert [s["version"] for s in versioned] == ["1"]


def test_http_repository_load_unload(http: Any) -> None:
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert index["add_sub"]["state"] == "READY"
    http.load_model("spare")
    assert http.is_model_ready("spare") is True
    assert {"name": "spare", "version": "1", "state": "READY", "reason": ""} in (
        http.get_model_repository_index()
    )
    inputs, a, b = _add_sub((True, True), seed=7)
    np.testing.assert_array_equal(http.infer("spare", inputs).as_numpy("SUM"), a + b)
    http.unload_model("spare")
    assert http.is_model_ready("spare") is False


def test_http_errors(http: Any) -> None:
    from tritonclient.utils import InferenceServerException

    inputs, _, _ = _add_sub((True, True))
    with pytest.raises(InferenceServerException) as info:
        http.infer("nope", inputs)
    assert info.value.status() == "404"
    assert "unknown model 'nope'" in info.value.message()


@pytest.mark.parametrize(
    ("header_length", "data", "message"),
    [
        ("9999", 16, "Inference-Header-Content-Length is 9999 but the body has"),
        (None, 12, "which is 16 bytes; received 12 bytes"),
        (None, 20, "binary_data_size values add up to 16"),
    ],
)
def test_http_malformed_binary_is_400(
    sluice: Any, header_length: str | None, data: int, message: str
) -> None:
    import httpx

    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4]}
    tensor["parameters"] = {"binary_data_size": min(data, 16)}
    other = {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    header = json.dumps({"inputs": [tensor, other]}).encode()
    response = httpx.post(
        f"{sluice.url}/v2/models/add_sub/infer",
        content=header + bytes(data),
        headers={"Inference-Header-Content-Length": header_length or str(len(header))},
        timeout=30,
    )
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_http_raw_body_as_perf_analyzer_sends_it(sluice: Any) -> None:
    import httpx

    inputs = [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
    ]
    inputs[0]["parameters"] = {"binary_data_size": 16}
    outputs = [{"name": "SUM", "parameters": {"binary_data": True}}, {"name": "DIFF"}]
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    body = gzip.compress(header + np.ones(4, np.float32).tobytes())
    response = httpx.post(
        f"{sluice.url}/v2/models/add_sub/infer",
        content=body,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Encoding": "gzip",
            "Content-Type": "application/octet-stream",
        },
        timeout=30,
    )
    assert response.status_code == 200, response.text
    size = int(response.headers["inference-header-content-length"])
    document = json.loads(response.content[:size])
    assert document["outputs"][1]["data"] == [0.0, -1.0, -2.0, -3.0]
    assert np.frombuffer(response.content[size:], np.float32).tolist() == [2.0, 3.0, 4.0, 5.0]


if __name__ == "__main__":
    if sys.argv[1:2] == ["grpc"]:
        print(json.dumps(grpc_calls(sys.argv[2])))
