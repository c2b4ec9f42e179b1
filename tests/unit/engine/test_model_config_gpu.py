"""The GPU parts of a model's config.yaml: instance groups, execution providers with options,
require_providers and the tensorrt section; each mistake named with what was received."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_config import load_model_config
from engine.settings import SettingsError


def config_from(tmp_path: Path, text: str) -> object:
    (tmp_path / "config.yaml").write_text(text)
    return load_model_config(tmp_path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(SettingsError) as caught:
        config_from(tmp_path, text)
    return str(caught.value)


def test_instance_groups_count_per_gpu(tmp_path: Path) -> None:
    config = config_from(
        tmp_path,
        "instances:\n  - {count: 2, kind: gpu, gpus: [0, 1]}\n  - {count: 1, kind: cpu}\n"
        "onnxruntime:\n  execution_providers: [CUDAExecutionProvider]\n",
    )
    gpu, cpu = config.instance_groups  # type: ignore[attr-defined]
    assert gpu.devices == [0, 0, 1, 1]
    assert cpu.devices == []
    assert config.instance_count == 5  # type: ignore[attr-defined]


def test_a_bare_count_is_one_group(tmp_path: Path) -> None:
    config = config_from(tmp_path, "instances: 3\n")
    [group] = config.instance_groups  # type: ignore[attr-defined]
    assert (group.kind, group.count, config.instance_count) == ("cpu", 3, 3)  # type: ignore[attr-defined]
    trt = config_from(tmp_path, "backend: tensorrt\ninstances: 2\n")
    assert [g.devices for g in trt.instance_groups] == [[0, 0]]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("instances:\n  - {count: 1, kind: cpu, gpus: [0]}\n",
         "gpus [0] is set on an instance group of kind cpu; only kind gpu takes gpus"),
        ("instances:\n  - {count: 1, kind: gpu, gpus: [0, 0]}\n"
         "onnxruntime:\n  execution_providers: [CUDAExecutionProvider]\n",
         "gpus [0, 0] must list distinct device ordinals"),
        ("instances:\n  - {count: 1, kind: gpu, gpus: [-1]}\n", "greater than or equal to 0"),
        ("instances:\n  - {count: 1, kind: tpu}\n", "'cpu' or 'gpu'"),
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
        ("onnxruntime:\n  execution_providers: [CudaExecutionProvider]\n",
         "unknown execution provider 'CudaExecutionProvider'; ONNX Runtime knows "
         "TensorrtExecutionProvider, CUDAExecutionProvider"),
        ("onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, opts: {}}]\n",
         "unknown key"),
        ("onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, options: "
         "{device_id: [0]}}]\n", "device_id"),
        ("onnxruntime:\n  execution_providers: [CPUExecutionProvider, CPUExecutionProvider]\n",
         "lists a provider twice"),
        ("instances:\n  - {count: 1, kind: gpu, gpus: [1]}\n"
         "onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, "
         "options: {device_id: 0}}]\n",
         "CUDAExecutionProvider sets device_id, but instances of kind gpu choose their GPUs"),
        ("tensorrt:\n  workspace: 1\n", "tensorrt.workspace: unknown key"),
        ("tensorrt:\n  workspace_bytes: 0\n",
         "tensorrt.workspace_bytes: Input should be greater than 0"),
        ("tensorrt:\n  profile: -1\n", "tensorrt.profile"),
    ],
)  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(tmp_path, text)


def test_provider_entries_keep_their_options(tmp_path: Path) -> None:
    config = config_from(
        tmp_path,
        "onnxruntime:\n  require_providers: true\n  execution_providers:\n"
        "    - name: TensorrtExecutionProvider\n"
        "      options: {trt_fp16_enable: true, trt_engine_cache_path: /var/cache/trt}\n"
        "    - CUDAExecutionProvider\n",
    )
    ort_options = config.onnxruntime  # type: ignore[attr-defined]
    assert ort_options.require_providers is True
    assert ort_options.provider_names == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert ort_options.providers[0].options == {
        "trt_fp16_enable": True,
        "trt_engine_cache_path": "/var/cache/trt",
    }
