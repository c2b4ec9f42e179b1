"""A TensorRT model served end to end by a real `sluice serve` process whose cuda-python,
TensorRT and NVML are the fakes (tests/fakes, found on PYTHONPATH as real installs would be):
HTTP inference through the backend's buffers and streams, a shape outside the profile as a
400, Triton's KIND_GPU config, per-GPU metrics, and an engine built for another GPU refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fakes import tensorrt as fake_tensorrt
from tests.fakes.install import write_shims
from tests.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
TENSORS = [
    {"name": "x", "mode": "input", "dtype": "FLOAT", "shape": [-1, 4]},
    {"name": "ids", "mode": "input", "dtype": "INT64", "shape": [-1, -1]},
    {"name": "y", "mode": "output", "dtype": "FLOAT", "shape": [-1, 4], "copy_of": "x"},
    {"name": "ids_out", "mode": "output", "dtype": "INT64", "shape": [-1, -1], "copy_of": "ids"},
]
PROFILE = {"x": [[1, 4], [4, 4], [8, 4]], "ids": [[1, 1], [4, 16], [8, 32]]}
CONFIG = "backend: tensorrt\nmax_batch_size: 8\ninstances: [{count: 2, kind: gpu, gpus: [0]}]\n"


def publish(repository: Path, name: str, capability: tuple[int, int], gpu: str) -> None:
    version = repository / name / "1"
    version.mkdir(parents=True)
    (repository / name / "config.yaml").write_text(CONFIG)
    plan = fake_tensorrt.plan(TENSORS, [PROFILE], version="10.3.0", compute_capability=capability)
    (version / "model.plan").write_bytes(plan)
    record = {"version": "10.3.0", "gpu": gpu, "compute_capability": ".".join(map(str, capability))}
    (version / "conversion.json").write_text(json.dumps({"tensorrt": record}))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("gpu-serve")
    repository = folder / "models"
    publish(repository, "ident", (9, 0), "NVIDIA Fake GPU")
    publish(repository, "elsewhere", (8, 0), "NVIDIA A100-SXM4-80GB")
    shims = write_shims(folder / "site")
    process = ServerProcess(
        "--model-repository", str(repository), "--no-strict-readiness",
        env={"PYTHONPATH": f"{shims}:{ROOT}"}, log_path=folder / "server.log",
    ).start()  # fmt: skip
    yield process
    process.stop()


def infer(server: ServerProcess, rows: int, length: int) -> httpx.Response:
    rng = np.random.default_rng(rows * 100 + length)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    ids = rng.integers(0, 1 << 40, (rows, length))
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": x.ravel().tolist()},
            {
                "name": "ids",
                "datatype": "INT64",
                "shape": [rows, length],
                "data": ids.ravel().tolist(),
            },
        ]
    }
    response = httpx.post(f"{server.url}/v2/models/ident/infer", json=body, timeout=30)
    if response.status_code == 200:
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        assert outputs["y"]["shape"] == [rows, 4]
        np.testing.assert_array_equal(np.array(outputs["y"]["data"], np.float32), x.ravel())
        assert outputs["ids_out"]["data"] == ids.ravel().tolist()
    return response


def test_inference_runs_through_the_tensorrt_backend(server: ServerProcess) -> None:
    for rows, length in [(1, 1), (3, 7), (8, 32)]:
        assert infer(server, rows, length).status_code == 200


def test_a_shape_outside_the_profile_is_a_400_naming_the_range(server: ServerProcess) -> None:
    response = infer(server, 2, 40)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "input 'ids' has shape [2, 40]; the TensorRT engine's optimization profile 0 allows "
        "[1, 1] to [8, 32]"
    )


def test_triton_config_reports_kind_gpu(server: ServerProcess) -> None:
    config = httpx.get(f"{server.url}/v2/models/ident/config", timeout=10).json()
    assert config["platform"] == "tensorrt_plan"
    assert config["instance_group"] == [
        {"name": "ident_0", "count": 2, "kind": "KIND_GPU", "gpus": [0]}
    ]


def test_grpc_model_config_reports_kind_gpu(server: ServerProcess) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    config = client.get_model_config("ident", as_json=True)["config"]
    assert config["instance_group"] == [
        {"name": "ident_0", "count": 2, "kind": "KIND_GPU", "gpus": [0]}
    ]
    client.close()


def test_metrics_include_the_gpu(server: ServerProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'sluice_gpu_memory_total_bytes{gpu="0",name="NVIDIA Fake GPU"} 8.589934592e+10' in text


def test_an_engine_built_for_another_gpu_is_refused_with_the_fix(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/v2/models/elsewhere/ready", timeout=10)
    assert response.status_code == 503
    message = response.json()["error"]
    assert (
        "built with TensorRT 10.3.0 for NVIDIA A100-SXM4-80GB (compute capability 8.0)" in message
    )
    assert "NVIDIA Fake GPU (compute capability 9.0)" in message
    assert "rebuild it here with `sluice convert" in message
