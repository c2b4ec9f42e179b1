"""Small ONNX graphs built with onnx.helper (no torch), for the optimizer and runner tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def mlp(features: int = 8, hidden: int = 16, classes: int = 4, seed: int = 0) -> Any:
    """x[batch, features] -> MatMul, Add, Relu, MatMul, Add, Exp -> y[batch, classes]."""
    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.standard_normal((features, hidden)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(hidden).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((hidden, classes)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(classes).astype(np.float32) * 0.1,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Exp", ["h4"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def fixed_batch() -> Any:
    """x[1, 4] -> Relu -> y[1, 4]: a model whose first axis is not dynamic."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
