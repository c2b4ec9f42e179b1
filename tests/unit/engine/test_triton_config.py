"""engine.triton_config: a loaded model's configuration in Triton's JSON model-config shape
(instance groups as configured, KIND_GPU with the devices; tensors, version policy, batching)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.triton_config import triton_config
from server.settings import load_settings
from tests.models import identity_model, write_model

GPU_CONFIG = (
    "instances:\n  - {count: 2, kind: gpu, gpus: [0, 1]}\n  - {count: 1, kind: cpu}\n"
    # CUDA is absent here, so the sessions fall back to CPU; the config is still reported.
    "onnxruntime:\n  execution_providers: [CUDAExecutionProvider, CPUExecutionProvider]\n"
    "warmup:\n  enabled: false\n"
)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    write_model(tmp_path, "g", identity_model("FP32"), GPU_CONFIG)
    write_model(tmp_path, "c", identity_model("FP32"), "instances: 3\n")
    write_model(
        tmp_path,
        "b",
        identity_model("BYTES"),
        "max_batch_size: 8\nversion_policy: {all: true}\ndynamic_batching:\n"
        "  max_queue_delay_s: 0.0005\n  preferred_batch_sizes: [2, 4]\n  max_queue_size: 64\n"
        "  priority_levels: 2\n  default_timeout_s: 0.25\n",
    )
    write_model(
        tmp_path, "a", identity_model("INT8"), "dynamic_batching: {max_queue_delay_s: auto}\n"
    )
    write_model(tmp_path, "u", identity_model("FP16", dims=(3, 4)), "max_batch_size: 0\n")
    engine = Engine(load_settings(model_repository=tmp_path, grpc_enabled=False))
    await engine.start()
    yield engine
    await engine.close()


def test_gpu_groups_are_kind_gpu_with_their_devices(engine: Engine) -> None:
    assert triton_config(engine.registry.resolve("g", None))["instance_group"] == [
        {"name": "g_0", "count": 2, "kind": "KIND_GPU", "gpus": [0, 1]},
        {"name": "g_1", "count": 1, "kind": "KIND_CPU"},
    ]


def test_a_bare_count_on_cpu_is_kind_cpu(engine: Engine) -> None:
    assert triton_config(engine.registry.resolve("c", None))["instance_group"] == [
        {"name": "c_0", "count": 3, "kind": "KIND_CPU"}
    ]


def test_gpu_instances_run_batches_concurrently(engine: Engine) -> None:
    model = engine.registry.resolve("g", None)
    assert model.batcher.policy.instances == 2 * 2 + 1


def test_tensors_drop_the_batch_axis_and_take_tritons_type_names(engine: Engine) -> None:
    config = triton_config(engine.registry.resolve("b", None))
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_STRING", "dims": [4]}]
    assert config["output"] == [{"name": "OUTPUT0", "data_type": "TYPE_STRING", "dims": [4]}]
    assert config["max_batch_size"] == 8
    assert config["default_model_filename"] == "model.onnx"
    assert config["backend"] == "onnxruntime"


def test_an_unbatched_model_keeps_every_axis_and_has_no_dynamic_batching(engine: Engine) -> None:
    config = triton_config(engine.registry.resolve("u", None))
    assert config["max_batch_size"] == 0
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP16", "dims": [3, 4]}]
    assert "dynamic_batching" not in config


def test_the_version_policy_the_triton_way(engine: Engine) -> None:
    assert triton_config(engine.registry.resolve("b", None))["version_policy"] == {"all": {}}
    latest = triton_config(engine.registry.resolve("c", None))["version_policy"]
    assert latest == {"latest": {"num_versions": 1}}


def test_dynamic_batching_in_microseconds(engine: Engine) -> None:
    batching = triton_config(engine.registry.resolve("b", None))["dynamic_batching"]
    assert batching["preferred_batch_size"] == [2, 4]
    assert batching["max_queue_delay_microseconds"] == 500
    assert batching["priority_levels"] == 2
    assert batching["default_queue_policy"] == {
        "max_queue_size": 64,
        "default_timeout_microseconds": 250_000,
        "allow_timeout_override": True,
        "timeout_action": "REJECT",
    }


def test_an_auto_delay_has_no_triton_equivalent_and_reports_zero(engine: Engine) -> None:
    config = triton_config(engine.registry.resolve("a", None))
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert config["input"][0]["data_type"] == "TYPE_INT8"


def test_the_sluice_config_goes_back_as_written(engine: Engine) -> None:
    parameters = triton_config(engine.registry.resolve("a", None))["parameters"]
    assert json.loads(parameters["sluice_config"]["string_value"]) == {
        "dynamic_batching": {"max_queue_delay_s": "auto"}
    }
