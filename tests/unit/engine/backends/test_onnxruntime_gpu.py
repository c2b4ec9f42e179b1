"""ONNX Runtime's GPU paths: provider options, require_providers, per-device sessions for gpu
instances and IO binding. On this CPU-only build the session-level checks run for real; the
`gpu`-marked test runs the CUDA provider where onnxruntime-gpu and a GPU are present."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engine.backends.onnxruntime import OnnxBackend, run_bound, session_providers
from engine.demo import mlp_model
from engine.errors import BackendError
from engine.model_config import InstanceGroup, OnnxRuntimeOptions
from tests.models import run_onnx, sample, write_model

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
HAS_CUDA = CUDA in ort.get_available_providers()


def backend_for(
    tmp_path: Path, groups: list[InstanceGroup] | None = None, **options: Any
) -> OnnxBackend:
    path = write_model(tmp_path, "m", mlp_model())
    return OnnxBackend(path, OnnxRuntimeOptions(**options), "model 'm' version 1", groups or [])


def test_provider_options_are_passed_as_ort_strings() -> None:
    options = OnnxRuntimeOptions(
        execution_providers=[
            {"name": TRT, "options": {"trt_fp16_enable": True, "trt_engine_cache_enable": True,
                                      "trt_engine_cache_path": "/cache/trt"}},
            {"name": CUDA, "options": {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC"}},
            CPU,
        ]
    )  # fmt: skip
    assert session_providers(options, [TRT, CUDA, CPU], None) == [
        (TRT, {"trt_fp16_enable": "true", "trt_engine_cache_enable": "true",
               "trt_engine_cache_path": "/cache/trt"}),
        (CUDA, {"device_id": "1", "cudnn_conv_algo_search": "HEURISTIC"}),
        (CPU, {}),
    ]  # fmt: skip


def test_a_gpu_instance_puts_every_gpu_provider_on_its_device() -> None:
    options = OnnxRuntimeOptions(
        execution_providers=[{"name": TRT, "options": {"trt_fp16_enable": False}}, CUDA]
    )
    assert session_providers(options, [TRT, CUDA, CPU], 3) == [
        (TRT, {"trt_fp16_enable": "false", "device_id": "3"}),
        (CUDA, {"device_id": "3"}),
        (CPU, {}),
    ]
    assert session_providers(options, [CPU], 3) == [(CPU, {})]  # unavailable ones are skipped


def test_a_required_provider_that_does_not_run_fails_the_load(tmp_path: Path) -> None:
    if HAS_CUDA:
        pytest.skip("this onnxruntime runs CUDA: the fallback cannot happen here")
    with pytest.raises(BackendError) as caught:
        backend_for(tmp_path, execution_providers=[CUDA, CPU], require_providers=True)
    message = str(caught.value)
    assert message.startswith(
        "model 'm' version 1 requires CUDAExecutionProvider (onnxruntime.require_providers), "
        "but CPUExecutionProvider runs: this onnxruntime build has "
    )
    assert "onnxruntime-gpu (the `gpu` extra)" in message


def test_without_require_providers_the_fallback_still_serves(tmp_path: Path) -> None:
    if HAS_CUDA:
        pytest.skip("this onnxruntime runs CUDA: the fallback cannot happen here")
    backend = backend_for(tmp_path, execution_providers=[CUDA, CPU])
    assert backend.provider == CPU


def test_a_required_provider_that_runs_loads(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, execution_providers=[CPU], require_providers=True)
    x = sample("FP32", (3, 16))
    expected = run_onnx(mlp_model(), {"x": x})["probabilities"]
    assert np.array_equal(backend.run({"x": x})["probabilities"], expected)


def test_cpu_instances_share_one_session(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, [InstanceGroup(count=4, kind="cpu")])
    assert len(backend._sessions) == 1
    assert backend.instance_slots == 1  # one warm-up run warms the shared session


def test_gpu_instances_get_a_session_each_and_share_none(tmp_path: Path) -> None:
    if HAS_CUDA:
        pytest.skip("covered on the GPU by the gpu-marked test")
    # CUDA is absent, so each per-device session falls back to CPU: the pool logic still runs.
    groups = [InstanceGroup(count=2, kind="gpu", gpus=[0, 1]), InstanceGroup(count=1)]
    backend = backend_for(tmp_path, groups, execution_providers=[CUDA, CPU])
    assert len(backend._sessions) == 5  # 4 gpu instances + 1 shared by the cpu group
    assert backend.instance_slots == 5  # warm-up reaches every session
    feeds = [sample("FP32", (1 + i % 7, 16)) for i in range(40)]
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda x: backend.run({"x": x})["probabilities"], feeds))
    for x, got in zip(feeds, results, strict=True):
        assert np.array_equal(got, run_onnx(mlp_model(), {"x": x})["probabilities"])


def test_bound_run_equals_a_plain_run(tmp_path: Path) -> None:
    path = write_model(tmp_path, "m", mlp_model())
    session = ort.InferenceSession(str(path), providers=[CPU])
    x = sample("FP32", (5, 16))
    [bound] = run_bound(session, ["probabilities"], {"x": x})
    [plain] = session.run(["probabilities"], {"x": x})
    assert bound.dtype == plain.dtype
    assert np.array_equal(bound, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a working CUDA provider")
def test_cuda_instances_run_on_their_gpu_and_match_cpu(tmp_path: Path) -> None:
    backend = backend_for(
        tmp_path, [InstanceGroup(count=2, kind="gpu", gpus=[0])],
        execution_providers=[CUDA, CPU], require_providers=True,
    )  # fmt: skip
    assert backend.provider == CUDA
    assert len(backend._sessions) == 2
    x = sample("FP32", (8, 16))
    expected = run_onnx(mlp_model(), {"x": x})["probabilities"]
    for _ in range(3):
        np.testing.assert_allclose(backend.run({"x": x})["probabilities"], expected, atol=1e-5)
