"""A model's config.yaml: defaults, version policies, and errors that name the file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_config import (
    DynamicBatching,
    ModelConfig,
    VersionPolicy,
    effective_batching,
    load_model_config,
)
from engine.settings import BatchingDefaults, SettingsError


def load(tmp_path: Path, text: str) -> ModelConfig:
    (tmp_path / "config.yaml").write_text(text)
    return load_model_config(tmp_path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(SettingsError) as caught:
        load(tmp_path, text)
    message = str(caught.value)
    assert str(tmp_path / "config.yaml") in message
    return message


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


def test_non_mapping_config_names_the_file(tmp_path: Path) -> None:
    message = error_of(tmp_path, "- max_batch_size\n")
    assert "expected a mapping" in message


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


def test_effective_batching_fills_server_defaults() -> None:
    defaults = BatchingDefaults(max_queue_delay_s=0.5, max_queue_size=99)
    assert effective_batching(ModelConfig(), defaults) == (0.5, 99)
    own = ModelConfig(dynamic_batching=DynamicBatching(max_queue_delay_s=0, max_queue_size=7))
    assert effective_batching(own, defaults) == (0, 7)


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
