from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from sklearn.datasets import load_diabetes, load_iris
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.tree import DecisionTreeClassifier

from converters.errors import ConversionError
from converters.export import (
    describe_export_error,
    finalize,
    onnx_specs,
    sklearn_to_onnx,
    torch_to_onnx,
)
from converters.runners import OnnxRunner
from converters.sources import Source
from converters.spec import Axis, parse_input
from tests.unit.converters import nets
from tests.unit.converters.graphs import mlp


def dims(value: object) -> list[object]:
    shape = value.type.tensor_type.shape.dim  # type: ignore[attr-defined]
    return [d.dim_param or d.dim_value for d in shape]


def test_onnx_specs_read_names_dtypes_and_dynamic_axes() -> None:
    [spec] = onnx_specs(mlp())
    assert spec.name == "x"
    assert spec.datatype == "FP32"
    assert spec.axes == (Axis(8, "N"), Axis(8))


def test_finalize_names_axes_after_the_specs_everywhere() -> None:
    model = finalize(mlp(), [parse_input("x:FP32:batch,8")])
    assert dims(model.graph.input[0]) == ["batch", 8]
    assert dims(model.graph.output[0]) == ["batch", 4]


def test_finalize_rejects_an_invalid_graph() -> None:
    model = mlp()
    model.graph.node.append(helper.make_node("Relu", ["missing"], ["z"]))
    with pytest.raises(ConversionError, match="the exported model is not valid ONNX"):
        finalize(model, onnx_specs(model))


def test_torch_export_names_inputs_outputs_and_shared_dynamic_axes() -> None:
    specs = [parse_input("a:FP32:-1,sequence=6"), parse_input("b:FP32:-1,sequence=6")]
    source = Source("torch", "two heads", nets.build_two_heads())
    model = finalize(torch_to_onnx(source, specs, ["sum", "dot"], None, "dynamo"), specs)
    assert [dims(v) for v in model.graph.input] == [["batch", "sequence"]] * 2
    assert {v.name: dims(v) for v in model.graph.output} == {
        "sum": ["batch", "sequence"],
        "dot": ["batch"],
    }
    a = np.ones((3, 11), np.float32)
    total, dot = OnnxRunner(model.SerializeToString()).run({"a": a, "b": a * 2})
    np.testing.assert_allclose(total, a * 3)
    np.testing.assert_allclose(dot, np.full(3, 22.0))


def test_unexportable_operator_is_named() -> None:
    source = Source("torch", "eigen", nets.build_eigen())
    with pytest.raises(ConversionError, match=r"^operator aten\.linalg_eig cannot be exported"):
        torch_to_onnx(source, [parse_input("x:FP32:-1,3,3")], ["y"], None, "dynamo")


def test_describe_export_error_for_legacy_and_unknown_messages() -> None:
    legacy = RuntimeError("Exporting the operator 'aten::fft_fft' to ONNX opset version 17 is ...")
    assert describe_export_error(legacy, 17).startswith(
        "operator aten::fft_fft cannot be exported to ONNX opset 17"
    )
    other = RuntimeError("\n\n<class 'torch._dynamo.exc.Unsupported'>: data-dependent branch\n")
    assert describe_export_error(other, None) == (
        "the model cannot be exported to ONNX: Unsupported: data-dependent branch"
    )


def test_sklearn_classifier_pipeline_gives_label_and_probability_tensors() -> None:
    x, y = load_iris(return_X_y=True)
    pipeline = make_pipeline(StandardScaler(), DecisionTreeClassifier(max_depth=3)).fit(x, y)
    model = sklearn_to_onnx(pipeline, [parse_input("input:FP32:-1,4")], None)
    assert [o.name for o in model.graph.output] == ["label", "probabilities"]
    label, proba = OnnxRunner(model.SerializeToString()).run({"input": x.astype(np.float32)})
    np.testing.assert_array_equal(label, pipeline.predict(x.astype(np.float32)))
    assert proba.shape == (150, 3)


def test_sklearn_regressor_in_double_precision() -> None:
    x, y = load_diabetes(return_X_y=True)
    ridge = Ridge().fit(x, y)
    model = sklearn_to_onnx(ridge, [parse_input("input:FP64:-1,10")], None)
    [prediction] = OnnxRunner(model.SerializeToString()).run({"input": x})
    np.testing.assert_allclose(prediction.ravel(), ridge.predict(x), rtol=1e-9)


def test_sklearn_errors() -> None:
    ridge = Ridge().fit(np.eye(3), np.arange(3))
    with pytest.raises(ConversionError, match="one input"):
        sklearn_to_onnx(ridge, [parse_input("a:FP32:-1,3"), parse_input("b:FP32:-1,3")], None)
    with pytest.raises(ConversionError, match="dtype INT8 is not supported"):
        sklearn_to_onnx(ridge, [parse_input("a:INT8:-1,3")], None)

    class Custom(Ridge):  # type: ignore[misc]
        pass

    with pytest.raises(ConversionError, match="skl2onnx cannot convert Custom"):
        sklearn_to_onnx(Custom().fit(np.eye(3), np.arange(3)), [parse_input("a:FP32:-1,3")], None)
