from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, numpy_helper

from converters.optimize import (
    U8S8_WEIGHT_LIMIT,
    ort_optimize,
    quantize_int8,
    simplify,
    to_fp16,
)
from converters.runners import OnnxRunner
from tests.unit.converters.graphs import mlp


def outputs(model: object, x: np.ndarray) -> np.ndarray:
    return OnnxRunner(model.SerializeToString()).run({"x": x})[0]  # type: ignore[attr-defined]


X = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)


def int8_peak(model: object) -> int:
    """The largest |value| of the model's int8 tensors (its quantized weights)."""
    return max(
        int(np.abs(numpy_helper.to_array(init).astype(np.int64)).max())
        for init in model.graph.initializer  # type: ignore[attr-defined]
        if init.data_type == TensorProto.INT8
    )


def test_simplify_keeps_the_function() -> None:
    model = mlp()
    simplified = simplify(model)
    assert len(simplified.graph.node) <= len(model.graph.node)
    np.testing.assert_allclose(outputs(simplified, X), outputs(model, X), rtol=1e-6)


def test_fp16_keeps_fp32_io_and_blocked_ops_in_fp32() -> None:
    converted = to_fp16(mlp())
    assert converted.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert converted.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    weights = {init.name: init.data_type for init in converted.graph.initializer}
    assert weights["w1"] == TensorProto.FLOAT16
    producers = {out: node for node in converted.graph.node for out in node.output}
    [exp] = [node for node in converted.graph.node if node.op_type == "Exp"]
    cast = producers[exp.input[0]]
    assert cast.op_type == "Cast"  # Exp overflows in fp16: it gets fp32 input
    assert {a.name: a.i for a in cast.attribute}["to"] == TensorProto.FLOAT
    np.testing.assert_allclose(outputs(converted, X), outputs(mlp(), X), rtol=2e-2, atol=1e-2)


def test_fp16_io_when_asked_and_block_list_is_extended() -> None:
    converted = to_fp16(mlp(), block=["Relu"], keep_io_types=False)
    assert converted.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    producers = {out: node for node in converted.graph.node for out in node.output}
    [relu] = [node for node in converted.graph.node if node.op_type == "Relu"]
    assert producers[relu.input[0]].op_type == "Cast"


def test_dynamic_int8_quantizes_matmuls(tmp_path: Path) -> None:
    quantized = quantize_int8(mlp(), tmp_path)
    ops = {node.op_type for node in quantized.graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
    assert int8_peak(quantized) == U8S8_WEIGHT_LIMIT  # 7 bits: x86 without VNNI cannot saturate
    a, b = outputs(quantized, X), outputs(mlp(), X)
    assert np.dot(a.ravel(), b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b) > 0.99


def test_static_int8_is_qdq_per_channel_calibrated(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    calibration = [{"x": rng.standard_normal((8, 8)).astype(np.float32)} for _ in range(4)]
    quantized = quantize_int8(mlp(), tmp_path, calibration, per_channel=True)
    nodes = quantized.graph.node
    assert any(node.op_type == "QuantizeLinear" for node in nodes)
    weight_dq = [
        node for node in nodes if node.op_type == "DequantizeLinear" and "w1" in node.input[0]
    ]
    assert weight_dq
    assert any(attr.name == "axis" for attr in weight_dq[0].attribute)  # per channel
    assert int8_peak(quantized) == U8S8_WEIGHT_LIMIT
    a, b = outputs(quantized, X), outputs(mlp(), X)
    assert np.dot(a.ravel(), b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b) > 0.98


def test_symmetric_static_int8_uses_signed_activations(tmp_path: Path) -> None:
    calibration = [{"x": X}]
    quantized = quantize_int8(mlp(), tmp_path, calibration, per_channel=False, symmetric=True)
    types = {init.name: init.data_type for init in quantized.graph.initializer}
    activation_zero_points = {
        types[node.input[2]] for node in quantized.graph.node if node.op_type == "QuantizeLinear"
    }
    assert activation_zero_points == {TensorProto.INT8}
    # For TensorRT, whose kernels do not saturate, weights keep all 8 bits.
    tensorrt = quantize_int8(mlp(), tmp_path, calibration, symmetric=True, reduce_range=False)
    assert int8_peak(tensorrt) == 127


def test_ort_optimize_saves_an_equivalent_model_with_only_used_opsets(tmp_path: Path) -> None:
    optimized = ort_optimize(mlp(), "extended", tmp_path)
    domains = {opset.domain for opset in optimized.opset_import}
    assert "ai.onnx.training" not in domains
    used = {node.domain for node in optimized.graph.node} | {""}
    assert domains == used
    np.testing.assert_allclose(outputs(optimized, X), outputs(mlp(), X), rtol=1e-5)
    assert ort_optimize(mlp(), "disable", tmp_path) == mlp()
