"""The sections of a model's config.yaml: version policies, dynamic batching's delays and
priorities, instance groups, execution providers with options, require_providers and the
tensorrt section; each mistake named with what was received
(engine/model_config_sections.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.model_config import ModelConfig, effective_batching, load_model_config
from engine.model_config_sections import VersionPolicy
from engine.settings import BatchingDefaults
from tests.unit.engine.config_files import error_of, load


def test_two_version_policies_are_rejected(tmp_path: Path) -> None:
    message = error_of(tmp_path, "version_policy:\n  latest: 2\n  all: true\n")
    assert "version_policy" in message
    assert "set only one of latest, all, specific" in message


@pytest.mark.parametrize("level", [0, 3])
def test_default_priority_level_is_one_of_the_levels(tmp_path: Path, level: int) -> None:
    text = f"dynamic_batching:\n  priority_levels: 2\n  default_priority_level: {level}\n"
    message = error_of(tmp_path, text)
    assert (
        f"default_priority_level {level} is not a priority level: levels are 1 (highest) to 2 "
        "(lowest)"
    ) in message


def test_default_priority_level_defaults_to_the_lowest_level(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("dynamic_batching:\n  priority_levels: 3\n")
    batching = load_model_config(tmp_path).dynamic_batching
    assert (batching.priority_levels, batching.default_level) == (3, 3)
    assert ModelConfig().dynamic_batching.default_level == 1


def test_the_old_default_priority_key_says_what_replaced_it(tmp_path: Path) -> None:
    message = error_of(tmp_path, "dynamic_batching:\n  priority_levels: 2\n  default_priority: 1\n")
    assert "default_priority was replaced by default_priority_level" in message
    assert "1 is the highest" in message


@pytest.mark.parametrize(
    ("policy", "versions", "served"),
    [
        (VersionPolicy(), [1, 3, 2], [3]),
        (VersionPolicy(latest=2), [1, 3, 2], [3, 2]),
        (VersionPolicy(latest=5), [1, 2], [2, 1]),
        (VersionPolicy(all=True), [2, 10, 1], [10, 2, 1]),
        (VersionPolicy(specific=[1, 3]), [1, 2, 3], [3, 1]),
        (VersionPolicy(specific=[7]), [1, 2], []),
        (VersionPolicy(), [], []),
    ],
)
def test_version_policy_select(
    policy: VersionPolicy, versions: list[int], served: list[int]
) -> None:
    assert policy.select(versions) == served


def test_auto_delay_and_latency_target_are_read(tmp_path: Path) -> None:
    config = load(
        tmp_path, "dynamic_batching:\n  max_queue_delay_s: auto\n  latency_target_s: 0.05\n"
    )
    assert config.dynamic_batching.max_queue_delay_s == "auto"
    assert config.dynamic_batching.latency_target_s == 0.05
    delay, _ = effective_batching(config, BatchingDefaults(max_queue_delay_s=0.5))
    assert delay == "auto"


def test_a_delay_that_is_neither_seconds_nor_auto_is_one_clear_error(tmp_path: Path) -> None:
    message = error_of(tmp_path, "dynamic_batching:\n  max_queue_delay_s: fast\n")
    assert "max_queue_delay_s must be seconds (0 to 10) or auto (got 'fast')" in message
    assert "literal" not in message


@pytest.mark.parametrize("delay", ["", "  max_queue_delay_s: 0.002\n"])
def test_a_latency_target_needs_the_auto_delay(tmp_path: Path, delay: str) -> None:
    message = error_of(tmp_path, f"dynamic_batching:\n{delay}  latency_target_s: 0.05\n")
    assert "latency_target_s 0.05 is the deadline max_queue_delay_s: auto plans for" in message
    assert ("is unset" if not delay else "is 0.002") in message


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
        ("onnxruntime:\n  execution_providers: [CudaExecutionProvider]\n",
         "unknown execution provider 'CudaExecutionProvider'; ONNX Runtime knows "
         "TensorrtExecutionProvider, CUDAExecutionProvider"),
        ("onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, opts: {}}]\n",
         "unknown key"),
        ("onnxruntime:\n  execution_providers: [{name: CUDAExecutionProvider, options: "
         "{device_id: [0]}}]\n", "device_id"),
        ("onnxruntime:\n  execution_providers: [CPUExecutionProvider, CPUExecutionProvider]\n",
         "lists a provider twice"),
        ("tensorrt:\n  workspace: 1\n", "tensorrt.workspace: unknown key"),
        ("tensorrt:\n  activation_memory_bytes: 0\n",
         "tensorrt.activation_memory_bytes: Input should be greater than 0"),
        ("tensorrt:\n  workspace_bytes: 1\n  activation_memory_bytes: 1\n",
         "workspace_bytes is the deprecated name of activation_memory_bytes: give only "
         "activation_memory_bytes"),
        ("tensorrt:\n  profile: -1\n", "tensorrt.profile"),
    ],
)  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(tmp_path, text)


def test_the_old_workspace_name_still_limits_activation_memory_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.model_config"):
        config = load(tmp_path, "tensorrt:\n  workspace_bytes: 4096\n")
    assert config.tensorrt.activation_memory_bytes == 4096
    [record] = caplog.records
    assert record.getMessage().startswith(
        "tensorrt.workspace_bytes is deprecated: it limits activation memory at serve time, so "
        "it is now tensorrt.activation_memory_bytes"
    )


def test_provider_entries_keep_their_options(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "onnxruntime:\n  require_providers: true\n  execution_providers:\n"
        "    - name: TensorrtExecutionProvider\n"
        "      options: {trt_fp16_enable: true, trt_engine_cache_path: /var/cache/trt}\n"
        "    - CUDAExecutionProvider\n",
    )
    ort_options = config.onnxruntime
    assert ort_options.require_providers is True
    assert ort_options.provider_names == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert ort_options.providers[0].options == {
        "trt_fp16_enable": True,
        "trt_engine_cache_path": "/var/cache/trt",
    }
