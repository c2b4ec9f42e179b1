"""Triton's model config reports instance groups as configured: KIND_GPU with the devices."""

from __future__ import annotations

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
