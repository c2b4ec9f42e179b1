"""A model's config.yaml: defaults, the errors that name the file, key and value, the checks
across sections (instances against the backend and its providers) and the batching values
with the server's defaults (engine/model_config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_config import ModelConfig, effective_batching, load_model_config
from engine.model_config_sections import DynamicBatching
from engine.settings import BatchingDefaults
from tests.unit.engine.config_files import error_of, load


def test_no_config_file_gives_defaults_to_auto_complete(tmp_path: Path) -> None:
    config = load_model_config(tmp_path)
    assert config.max_batch_size is None  # derived from the model at load
    assert config.backend == "onnxruntime"
    assert config.version_policy.select([1, 2, 3]) == [3]
    assert config.onnxruntime.execution_providers == ["CPUExecutionProvider"]
    assert config.warmup.enabled


def test_fields_are_read(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "max_batch_size: 8\ninstances: 2\nversion_policy:\n  all: true\n"
        "onnxruntime:\n  intra_op_threads: 2\n  graph_optimization_level: basic\n"
        "  execution_providers: [CUDAExecutionProvider, CPUExecutionProvider]\n"
        "dynamic_batching:\n  max_queue_delay_s: 0.01\n  preferred_batch_sizes: [4, 8]\n"
        "warmup:\n  batch_sizes: [1, 8]\ncache:\n  enabled: true\n  ttl_s: 5\n",
    )
    assert config.max_batch_size == 8
    assert config.instances == 2
    assert config.version_policy.all
    assert config.onnxruntime.intra_op_threads == 2
    assert config.onnxruntime.graph_optimization_level == "basic"
    assert config.onnxruntime.execution_providers[0] == "CUDAExecutionProvider"
    assert config.dynamic_batching.preferred_batch_sizes == [4, 8]
    assert config.warmup.batch_sizes == [1, 8]
    assert (config.cache.enabled, config.cache.ttl_s) == (True, 5)


def test_unknown_key_names_file_key_and_allowed_keys(tmp_path: Path) -> None:
    message = error_of(tmp_path, "max_batch: 8\n")
    assert "max_batch: unknown key" in message
    for allowed in ("max_batch_size", "version_policy", "dynamic_batching", "onnxruntime"):
        assert allowed in message


def test_unknown_nested_key_names_dotted_path(tmp_path: Path) -> None:
    message = error_of(tmp_path, "onnxruntime:\n  intra_threads: 2\n")
    assert "onnxruntime.intra_threads: unknown key" in message
    assert "intra_op_threads" in message


@pytest.mark.parametrize(
    ("text", "key", "shown"),
    [
        ("max_batch_size: -1\n", "max_batch_size", "-1"),
        ("max_batch_size: many\n", "max_batch_size", "'many'"),
        ("max_batch_size: 3000000000\n", "max_batch_size", "3000000000"),  # Triton's is int32
        ("dynamic_batching:\n  preferred_batch_sizes: [4, 3000000000]\n",
         "dynamic_batching.preferred_batch_sizes.1", "3000000000"),
        ("instances: 0\n", "instances", "0"),
        ("instances: 65\n", "instances", "65"),
        ("backend: tensorflow\n", "backend", "'tensorflow'"),
        ("version_policy:\n  latest: 0\n", "version_policy.latest", "0"),
        ("onnxruntime:\n  graph_optimization_level: max\n", "onnxruntime.graph_optimization_level",
         "'max'"),
        ("dynamic_batching:\n  max_queue_delay_s: 11\n", "dynamic_batching.max_queue_delay_s",
         "11"),
        ("cache:\n  ttl_s: 0\n", "cache.ttl_s", "0"),
    ],
)  # fmt: skip
def test_bad_value_names_key_and_value(tmp_path: Path, text: str, key: str, shown: str) -> None:
    message = error_of(tmp_path, text)
    line = next(line for line in message.splitlines() if line.strip().startswith(f"{key}:"))
    assert f"(got {shown})" in line


def test_non_mapping_config_names_the_file(tmp_path: Path) -> None:
    message = error_of(tmp_path, "- max_batch_size\n")
    assert "expected a mapping" in message


def test_effective_batching_fills_server_defaults() -> None:
    defaults = BatchingDefaults(max_queue_delay_s=0.5, max_queue_size=99)
    assert effective_batching(ModelConfig(), defaults) == (0.5, 99)
    own = ModelConfig(dynamic_batching=DynamicBatching(max_queue_delay_s=0, max_queue_size=7))
    assert effective_batching(own, defaults) == (0, 7)


def test_instance_groups_count_per_gpu(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "instances:\n  - {count: 2, kind: gpu, gpus: [0, 1]}\n  - {count: 1, kind: cpu}\n"
        "onnxruntime:\n  execution_providers: [CUDAExecutionProvider]\n",
    )
    gpu, cpu = config.instance_groups
    assert gpu.devices == [0, 0, 1, 1]
    assert cpu.devices == []
    assert config.instance_count == 5


def test_a_bare_count_is_one_group(tmp_path: Path) -> None:
    config = load(tmp_path, "instances: 3\n")
    [group] = config.instance_groups
    assert (group.kind, group.count, config.instance_count) == ("cpu", 3, 3)
    trt = load(tmp_path, "backend: tensorrt\ninstances: 2\n")
    assert [g.devices for g in trt.instance_groups] == [[0, 0]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("instances: []\n", "instances lists no instance group"),
        ("instances:\n  - {count: 40, kind: gpu, gpus: [0, 1]}\n"
         "onnxruntime:\n  execution_providers: [CUDAExecutionProvider]\n",
         "instances must add up to 1 to 64, not 80"),
        ("instances:\n  - {count: 1, kind: gpu}\n",
         "instances of kind gpu need a GPU provider (one of TensorrtExecutionProvider, "
         "CUDAExecutionProvider) in onnxruntime.execution_providers; it lists "
         "CPUExecutionProvider"),
        ("backend: tensorrt\ninstances:\n  - {count: 1, kind: cpu}\n",
         "backend tensorrt runs on GPUs only"),
        ("instances:\n  - {count: 1, kind: gpu, gpus: [1]}\n"
         "onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, "
         "options: {device_id: 0}}]\n",
         "CUDAExecutionProvider sets device_id, but instances of kind gpu choose their GPUs"),
    ],
)  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(tmp_path, text)
