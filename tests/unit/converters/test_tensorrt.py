from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from converters.errors import MissingDependency
from converters.spec import parse_input
from converters.tensorrt import build_engine, missing_requirements, profile_shapes, require_tensorrt
from engine.backends.tensorrt import TensorRTBackend
from engine.errors import BackendError
from engine.model_config import TensorRTOptions
from tests.fakes import tensorrt as fake_tensorrt
from tests.fakes.cuda_runtime import FakeCudaRuntime, cudaDeviceProp
from tests.fakes.install import install_cuda, install_tensorrt
from tests.models import identity_model
from tests.unit.converters.conftest import run_convert

MISSING = missing_requirements()


@pytest.mark.skipif(not MISSING, reason="this machine has TensorRT and a CUDA GPU")
def test_missing_tensorrt_or_gpu_is_named() -> None:
    with pytest.raises(MissingDependency) as caught:
        require_tensorrt()
    message = str(caught.value)
    assert message.startswith("--target tensorrt is not possible here: ")
    assert caught.value.missing == MISSING
    assert any("tensorrt package" in item or "CUDA GPU" in item for item in MISSING)


def test_profile_follows_max_batch_and_preferred_sizes() -> None:
    spec = parse_input("ids:INT64:-1,sequence=128")
    assert profile_shapes(spec, 32, [4, 16, 64]) == ((1, 1), (16, 128), (32, 128))
    assert profile_shapes(spec, 8, []) == ((1, 1), (8, 128), (8, 128))


def test_profile_of_an_unbatched_input_is_its_shape() -> None:
    spec = parse_input("x:FP32:1,3,224,224")
    assert profile_shapes(spec, 0, []) == ((1, 3, 224, 224),) * 3


@pytest.mark.gpu
@pytest.mark.skipif(bool(MISSING), reason=f"needs TensorRT and a CUDA GPU: {'; '.join(MISSING)}")
def test_fp16_engine_matches_onnx_runtime() -> None:
    import numpy as np

    from converters.runners import OnnxRunner
    from converters.tensorrt import TensorRTRunner
    from tests.unit.converters.graphs import mlp

    model = mlp().SerializeToString()
    specs = [parse_input("x:FP32:-1,8")]
    plan = build_engine(model, specs, 16, [8], "fp16").plan
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    [expected] = OnnxRunner(model).run({"x": x})
    [actual] = TensorRTRunner(plan).run({"x": x})
    np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2)


# -- builds, the engine cache and the build record, against the fakes (tests/fakes) -------------


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeCudaRuntime:
    runtime = FakeCudaRuntime([cudaDeviceProp(b"NVIDIA H100 80GB HBM3", 9, 0)])
    install_cuda(monkeypatch, runtime)
    install_tensorrt(monkeypatch)
    monkeypatch.setenv("SLUICE_TENSORRT_CACHE", str(tmp_path / "engine-cache"))
    return runtime


def identity_onnx() -> bytes:
    return identity_model("FP32", ("batch", 4), "x", "y").SerializeToString()


def test_a_build_records_what_the_engine_is_for(fakes: FakeCudaRuntime) -> None:
    build = build_engine(identity_onnx(), [parse_input("x:FP32:-1,4")], 16, [8], "fp16")
    assert build.record == {
        "version": "10.3.0",
        "gpu": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "precision": "fp16",
        "profiles": [{"x": {"min": [1, 4], "opt": [8, 4], "max": [16, 4]}}],
        "workspace_bytes": 1 << 30,
        "cache_key": build.record["cache_key"],
        "cached": False,
    }


def test_the_engine_cache_skips_rebuilds_of_the_same_build(
    fakes: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [parse_input("x:FP32:-1,4")]
    builds = fake_tensorrt.Builder.builds
    first = build_engine(identity_onnx(), specs, 16, [8], "fp16")
    again = build_engine(identity_onnx(), specs, 16, [8], "fp16")
    assert (again.plan, again.record["cached"]) == (first.plan, True)
    assert fake_tensorrt.Builder.builds == builds + 1
    others = [
        build_engine(identity_onnx(), specs, 16, [8], "fp32"),  # precision
        build_engine(identity_onnx(), specs, 32, [8], "fp16"),  # profile
        build_engine(identity_onnx(), specs, 16, [8], "fp16", workspace_bytes=1 << 20),
    ]
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.4.0")
    others.append(build_engine(identity_onnx(), specs, 16, [8], "fp16"))  # TensorRT version
    assert [o.record["cached"] for o in others] == [False] * 4
    assert len({first.record["cache_key"], *(o.record["cache_key"] for o in others)}) == 5


def test_convert_publishes_an_engine_the_server_loads_and_checks(
    fakes: FakeCudaRuntime, tmp_path: Path
) -> None:
    source = tmp_path / "identity.onnx"
    source.write_bytes(identity_onnx())
    repository = tmp_path / "repo"
    result = run_convert(
        source, "--target", "tensorrt", "--precision", "fp16", "--max-batch-size", "8",
        "--measure-iterations", "0", "--repository", repository, "--name", "ident",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((repository / "ident" / "1" / "conversion.json").read_text())
    assert record["validated_on"] == "TensorRT 10.3.0 on NVIDIA H100 80GB HBM3"
    assert record["validation"]["passed"] is True
    assert (record["tensorrt"]["version"], record["tensorrt"]["compute_capability"]) == (
        "10.3.0",
        "9.0",
    )
    plan = repository / "ident" / "1" / "model.plan"
    backend = TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(backend.run({"x": x})["y"], x)
    backend.close()
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA A100-SXM4-80GB", 8, 0)  # the same files, elsewhere
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
    assert "built with TensorRT 10.3.0 for NVIDIA H100 80GB HBM3 (compute capability 9.0)" in str(
        caught.value
    )
    assert (
        "this machine has TensorRT 10.3.0 and NVIDIA A100-SXM4-80GB (compute capability 8.0)"
        in (str(caught.value))
    )
