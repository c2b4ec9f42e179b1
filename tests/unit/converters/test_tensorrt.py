from __future__ import annotations

import pytest

from converters.errors import MissingDependency
from converters.spec import parse_input
from converters.tensorrt import missing_requirements, profile_shapes, require_tensorrt

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
    from converters.tensorrt import TensorRTRunner, build_engine
    from tests.unit.converters.graphs import mlp

    model = mlp().SerializeToString()
    specs = [parse_input("x:FP32:-1,8")]
    plan = build_engine(model, specs, 16, [8], "fp16")
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    [expected] = OnnxRunner(model).run({"x": x})
    [actual] = TensorRTRunner(plan).run({"x": x})
    np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2)
