"""engine.backends.provider_check, the GPU host's check that ONNX Runtime's TensorRT and CUDA
providers really run: on this CPU build it skips, and a session whose provider falls back is a
failure naming it; the gpu-marked test runs it for real."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from engine.backends.provider_check import CUDA, SKIP, TENSORRT, check, main
from engine.demo import mlp_model
from engine.errors import BackendError

HAS_CUDA = CUDA in ort.get_available_providers()


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_a_cpu_build_is_a_skip_that_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == SKIP
    assert capsys.readouterr().out.startswith("this onnxruntime is a CPU build (it has ")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_a_provider_that_falls_back_fails_the_check(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(mlp_model().SerializeToString())
    # ONNX Runtime warns and runs on CPU, as it does where a GPU provider cannot start.
    with (
        pytest.warns(UserWarning, match="not in available provider names"),
        pytest.raises(BackendError) as caught,
    ):
        check(model, CUDA, 0)
    assert str(caught.value).startswith(
        "the check's model requires CUDAExecutionProvider (onnxruntime.require_providers), but "
        "CPUExecutionProvider runs"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a working CUDA provider")
def test_the_providers_run_on_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    providers = [CUDA] + ([TENSORRT] if TENSORRT in ort.get_available_providers() else [])
    assert main([arg for p in providers for arg in ("--provider", p)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"PASS  {p} on GPU 0" for p in providers]
