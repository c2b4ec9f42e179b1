"""The KServe v2 HTTP/REST front-end of a real `sluice serve`: every endpoint, every datatype
round trip compared with running the same ONNX model in-process with ONNX Runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest

from engine.demo import mlp_model
from tests.models import (
    DATATYPES,
    NUMPY_TYPES,
    add_sub_model,
    fixed_shape_model,
    identity_model,
    model_name,
    run_onnx,
    sample,
    write_datatype_models,
    write_model,
)
from tests.servers import ServerProcess


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, onnx.ModelProto]]:
    repo = tmp_path_factory.mktemp("repo")
    found = write_datatype_models(repo)
    found["add_sub"] = add_sub_model()
    write_model(repo, "add_sub", found["add_sub"], "max_batch_size: 8\n")
    found["fixed"] = fixed_shape_model("FP32", (2, 3))
    write_model(repo, "fixed", found["fixed"])  # no config.yaml: auto-complete
    policy = "version_policy:\n  all: true\n"
    write_model(repo, "versioned", identity_model("FP32", ("batch", 4)), policy, version=1)
    write_model(repo, "versioned", identity_model("INT32", ("batch", 2)), policy, version=2)
    return repo, found


@pytest.fixture(scope="module")
def repo_server(
    models: tuple[Path, dict[str, onnx.ModelProto]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("repo-server") / "server.log"
    server = ServerProcess("--model-repository", str(models[0]), log_path=log, grpc=False)
    server.start()
    yield server
    server.stop()


def tensor_json(
    name: str, datatype: str, array: np.ndarray, nested: bool = False
) -> dict[str, Any]:
    if datatype == "BYTES":
        values: Any = np.array([v.decode() for v in array.ravel()], dtype=object)
    else:
        values = array.ravel()
    data = values.reshape(array.shape).tolist() if nested else values.tolist()
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def from_json(output: dict[str, Any]) -> np.ndarray:
    datatype = output["datatype"]
    if datatype == "BYTES":
        array = np.empty(len(output["data"]), dtype=object)
        array[:] = [v.encode() for v in output["data"]]
        return array.reshape(output["shape"])
    return np.array(output["data"], dtype=NUMPY_TYPES[datatype]).reshape(output["shape"])


def infer(server: ServerProcess, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}{path}", json=payload, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    return body


# -- health and server metadata -----------------------------------------------------------------


def test_health_live(demo_server: ServerProcess) -> None:
    response = httpx.get(f"{demo_server.url}/v2/health/live")
    assert (response.status_code, response.json()) == (200, {"live": True})


def test_health_ready(demo_server: ServerProcess) -> None:
    response = httpx.get(f"{demo_server.url}/v2/health/ready")
    assert (response.status_code, response.json()) == (200, {"ready": True})


def test_server_metadata(demo_server: ServerProcess) -> None:
    body = httpx.get(f"{demo_server.url}/v2").json()
    assert body["name"] == "sluice"
    assert body["version"] == "0.1.0"
    assert isinstance(body["extensions"], list)
    assert "binary_tensor_data" in body["extensions"]


# -- model metadata and readiness -----------------------------------------------------------------

DEMO_METADATA = {
    "name": "demo",
    "versions": ["1"],
    "platform": "onnxruntime_onnx",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}],
}


@pytest.mark.parametrize("path", ["/v2/models/demo", "/v2/models/demo/versions/1"])
def test_demo_model_metadata(demo_server: ServerProcess, path: str) -> None:
    response = httpx.get(f"{demo_server.url}{path}")
    assert (response.status_code, response.json()) == (200, DEMO_METADATA)


@pytest.mark.parametrize("path", ["/v2/models/demo/ready", "/v2/models/demo/versions/1/ready"])
def test_demo_model_ready(demo_server: ServerProcess, path: str) -> None:
    response = httpx.get(f"{demo_server.url}{path}")
    assert (response.status_code, response.json()) == (200, {"name": "demo", "ready": True})


def test_versioned_metadata(repo_server: ServerProcess) -> None:
    latest = httpx.get(f"{repo_server.url}/v2/models/versioned").json()
    assert latest["versions"] == ["1", "2"]
    assert latest["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 2]}]
    first = httpx.get(f"{repo_server.url}/v2/models/versioned/versions/1").json()
    assert first["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    ready = httpx.get(f"{repo_server.url}/v2/models/versioned/versions/1/ready")
    assert (ready.status_code, ready.json()["ready"]) == (200, True)


@pytest.mark.parametrize("datatype", DATATYPES)
def test_metadata_of_every_datatype(repo_server: ServerProcess, datatype: str) -> None:
    body = httpx.get(f"{repo_server.url}/v2/models/{model_name(datatype)}").json()
    assert body["inputs"] == [{"name": "INPUT0", "datatype": datatype, "shape": [-1, 4]}]
    assert body["outputs"] == [{"name": "OUTPUT0", "datatype": datatype, "shape": [-1, 4]}]


def test_auto_completed_fixed_shape_model(repo_server: ServerProcess) -> None:
    body = httpx.get(f"{repo_server.url}/v2/models/fixed").json()
    assert body["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 3]}]
    x = sample("FP32", (2, 3))
    out = infer(
        repo_server, "/v2/models/fixed/infer", {"inputs": [tensor_json("INPUT0", "FP32", x)]}
    )
    np.testing.assert_array_equal(from_json(out["outputs"][0]), x)


# -- inference --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v2/models/demo/infer", "/v2/models/demo/versions/1/infer"])
def test_demo_answer_equals_onnxruntime(demo_server: ServerProcess, path: str) -> None:
    x = sample("FP32", (3, 16), seed=11)
    body = infer(demo_server, path, {"inputs": [tensor_json("x", "FP32", x)]})
    assert (body["model_name"], body["model_version"]) == ("demo", "1")
    [output] = body["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("probabilities", "FP32",
                                                                     [3, 10])  # fmt: skip
    want = run_onnx(mlp_model(), {"x": x})["probabilities"]
    np.testing.assert_allclose(from_json(output), want, rtol=1e-5, atol=1e-7)


def test_demo_full_batch_and_nested_data(demo_server: ServerProcess) -> None:
    x = sample("FP32", (64, 16), seed=5)
    body = infer(demo_server, "/v2/models/demo/infer",
                 {"inputs": [tensor_json("x", "FP32", x, nested=True)]})  # fmt: skip
    want = run_onnx(mlp_model(), {"x": x})["probabilities"]
    np.testing.assert_allclose(from_json(body["outputs"][0]), want, rtol=1e-5, atol=1e-7)


def test_id_is_echoed(demo_server: ServerProcess) -> None:
    payload = {"id": "req-42 ✓", "inputs": [tensor_json("x", "FP32", sample("FP32", (1, 16)))]}
    assert infer(demo_server, "/v2/models/demo/infer", payload)["id"] == "req-42 ✓"
    del payload["id"]
    assert "id" not in infer(demo_server, "/v2/models/demo/infer", payload)


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_datatype_round_trip(
    repo_server: ServerProcess,
    models: tuple[Path, dict[str, onnx.ModelProto]],
    datatype: str,
    nested: bool,
) -> None:
    name = model_name(datatype)
    x = sample(datatype, (3, 4), seed=7)
    body = infer(repo_server, f"/v2/models/{name}/infer",
                 {"inputs": [tensor_json("INPUT0", datatype, x, nested)]})  # fmt: skip
    [output] = body["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("OUTPUT0", datatype, [3, 4])
    got = from_json(output)
    want = run_onnx(models[1][name], {"INPUT0": x})["OUTPUT0"]
    if datatype == "BYTES":
        assert got.tolist() == [[v.encode() for v in row] for row in want.tolist()]
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_outputs_selection(repo_server: ServerProcess) -> None:
    a, b = sample("FP32", (2, 4), seed=1), sample("FP32", (2, 4), seed=2)
    inputs = [tensor_json("INPUT0", "FP32", a), tensor_json("INPUT1", "FP32", b)]
    path = "/v2/models/add_sub/infer"
    both = infer(repo_server, path, {"inputs": inputs})
    assert [o["name"] for o in both["outputs"]] == ["SUM", "DIFF"]
    only = infer(repo_server, path, {"inputs": inputs, "outputs": [{"name": "DIFF"}]})
    assert [o["name"] for o in only["outputs"]] == ["DIFF"]
    want = run_onnx(add_sub_model(), {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(from_json(only["outputs"][0]), want["DIFF"])


def test_versions_answer_separately(repo_server: ServerProcess) -> None:
    x1, x2 = sample("FP32", (1, 4)), sample("INT32", (2, 2))
    v1 = infer(repo_server, "/v2/models/versioned/versions/1/infer",
               {"inputs": [tensor_json("INPUT0", "FP32", x1)]})  # fmt: skip
    latest = infer(repo_server, "/v2/models/versioned/infer",
                   {"inputs": [tensor_json("INPUT0", "INT32", x2)]})  # fmt: skip
    assert (v1["model_version"], latest["model_version"]) == ("1", "2")
    np.testing.assert_array_equal(from_json(v1["outputs"][0]), x1)
    np.testing.assert_array_equal(from_json(latest["outputs"][0]), x2)


def test_parameters_are_accepted(repo_server: ServerProcess) -> None:
    x = sample("FP32", (1, 4))
    payload = {
        "inputs": [{**tensor_json("INPUT0", "FP32", x), "parameters": {"note": "kept"}}],
        "parameters": {"timeout": 5_000_000, "priority": 0, "custom": [1, 2]},
    }
    body = infer(repo_server, f"/v2/models/{model_name('FP32')}/infer", payload)
    np.testing.assert_array_equal(from_json(body["outputs"][0]), x)
