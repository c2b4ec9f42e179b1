"""Request priorities through tritonclient (HTTP and gRPC, from PyPI, unchanged) against a real
`sluice serve`, numbered as Triton numbers them (issue 12, item 2): on a model with
`priority_levels: 3`, priority 3 (the lowest level) is served and priority 4 is refused with 400 /
INVALID_ARGUMENT naming the range; the model config reports the levels the Triton way.

tritonclient.grpc cannot be imported in the pytest process (see test_tritonclient.py), so the
gRPC calls run in a child process: this file run as a script (`python test_priority_e2e.py
HOST:PORT`) makes them and prints the results as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Three levels and no default_priority_level: requests that set none go to the lowest, 3.
CONFIG = "max_batch_size: 4\ndynamic_batching:\n  priority_levels: 3\n"
RANGE = "its priority levels are 1 (highest) to 3 (lowest), and 0 or none means its default level 3"


@pytest.fixture(scope="module")
def sluice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.models import identity_model, write_model
    from tests.servers import ServerProcess

    repo = tmp_path_factory.mktemp("priority-repo")
    write_model(repo, "levels", identity_model("FP32"), CONFIG)
    log = tmp_path_factory.mktemp("priority-server") / "server.log"
    server = ServerProcess("--model-repository", str(repo), log_path=log).start()
    yield server
    server.stop()


def x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 4)).astype(np.float32)


# -- HTTP, in this process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(sluice: Any) -> Iterator[Any]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{sluice.http_port}")
    yield client
    client.close()


def http_infer(http: Any, priority: int) -> Any:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    tensor.set_data_from_numpy(x(priority))
    return http.infer("levels", [tensor], priority=priority)


@pytest.mark.parametrize("priority", [0, 1, 2, 3])
def test_http_every_level_is_served(http: Any, priority: int) -> None:
    np.testing.assert_array_equal(http_infer(http, priority).as_numpy("OUTPUT0"), x(priority))


def test_http_priority_past_the_lowest_level_is_400(http: Any) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        http_infer(http, 4)
    assert info.value.status() == "400"
    assert f"priority 4 is out of range for model 'levels' version 1: {RANGE}" in str(
        info.value.message()
    )


def test_http_model_config_reports_levels_the_triton_way(http: Any) -> None:
    batching = http.get_model_config("levels")["dynamic_batching"]
    assert (batching["priority_levels"], batching["default_priority_level"]) == (3, 3)


# -- gRPC, in a child process ---------------------------------------------------------------------


def grpc_calls(url: str) -> dict[str, Any]:
    """The tritonclient.grpc calls the tests check; runs in the child process."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    out: dict[str, Any] = {}
    for priority in (0, 1, 3, 4):
        tensor = grpcclient.InferInput("INPUT0", [2, 4], "FP32")
        tensor.set_data_from_numpy(x(priority))
        try:
            result = client.infer("levels", [tensor], priority=priority)
        except InferenceServerException as exc:
            out[str(priority)] = [str(exc.status()), str(exc.message())]
        else:
            same = bool(np.array_equal(result.as_numpy("OUTPUT0"), x(priority)))
            out[str(priority)] = ["OK", same]
    config = client.get_model_config("levels", as_json=True)["config"]["dynamic_batching"]
    out["config"] = [config["priority_levels"], config["default_priority_level"]]
    client.close()
    return out


@pytest.fixture(scope="module")
def grpc_results(sluice: Any) -> dict[str, Any]:
    child = subprocess.run(
        [sys.executable, __file__, sluice.grpc_url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.returncode == 0, f"{child.stderr[-3000:]}\nserver log:\n{sluice.logs()}"
    results: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def test_grpc_levels_are_served_and_past_the_lowest_is_invalid_argument(
    grpc_results: dict[str, Any],
) -> None:
    assert grpc_results["0"] == ["OK", True]
    assert grpc_results["1"] == ["OK", True]
    assert grpc_results["3"] == ["OK", True]
    status, message = grpc_results["4"]
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert f"priority 4 is out of range for model 'levels' version 1: {RANGE}" in message


def test_grpc_model_config_reports_levels_the_triton_way(grpc_results: dict[str, Any]) -> None:
    # protobuf JSON writes uint64 fields as strings
    assert [int(value) for value in grpc_results["config"]] == [3, 3]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(json.dumps(grpc_calls(sys.argv[1])))
