"""ONNX Runtime's x86 int8 kernel without VNNI, emulated with standard ONNX ops, so that a test
on any host sees what an AVX2 host computes.

On AVX2 (and AVX-512 without VNNI) MLAS multiplies uint8 activations by int8 weights with
vpmaddubsw: the products of two neighbouring elements along K are added into an int16, which
saturates, and vpmaddwd then adds those pair sums in int32 (QgemmU8X8KernelAvx2). With VNNI the
products are added in int32 at once. `emulate_avx2` rewrites every MatMul/Gemm of a static QDQ
model whose inputs are a dequantized uint8 activation and a dequantized int8 constant into that
arithmetic: pair sums clipped to [-32768, 32767], then summed, the activation's zero point and the
scales applied (every value is an integer below 2**24, so float32 holds it exactly)."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

INT16 = (-32768.0, 32767.0)


def emulate_avx2(model: Any) -> tuple[Any, int]:
    """A copy of `model` computing its uint8 x int8 products as vpmaddubsw does, and how many
    products it rewrote."""
    emulated = type(model)()
    emulated.CopyFrom(model)
    graph = emulated.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    nodes: list[Any] = []
    rewritten = 0
    for node in graph.node:
        operands = [producers.get(name) for name in node.input[:2]]
        activation, weight = operands if len(operands) == 2 else (None, None)
        if (
            node.op_type not in ("MatMul", "Gemm")
            or activation is None
            or weight is None
            or activation.op_type != "DequantizeLinear"
            or weight.op_type != "DequantizeLinear"
            or constants.get(weight.input[0], np.zeros(0)).dtype != np.int8
        ):
            nodes.append(node)
            continue
        nodes += _saturating_product(node, activation, weight, constants, graph)
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return emulated, rewritten


def _saturating_product(
    node: Any, activation: Any, weight: Any, constants: dict[str, np.ndarray], graph: Any
) -> list[Any]:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    w = constants[weight.input[0]].astype(np.int64)
    if attributes.get("transB", 0):
        w = w.T
    assert attributes.get("transA", 0) == 0
    assert attributes.get("alpha", 1.0) == attributes.get("beta", 1.0) == 1.0
    k, n = w.shape
    assert k % 2 == 0, "an odd K (MLAS pads it with zeros) is not emulated"
    activation_scale = float(constants[activation.input[1]])
    activation_zero = float(constants[activation.input[2]])
    leading = [0] * (1 if node.op_type == "Gemm" else 2)  # Reshape's 0 copies the input's axis
    prefix = f"avx2_{node.output[0]}"

    def t(key: str) -> str:  # this product's tensor names
        return f"{prefix}_{key}"

    values = {
        "w_pairs": w.reshape(k // 2, 2, n).astype(np.float32),
        "shape": np.array([*leading, k // 2, 2, 1], np.int64),
        "low": np.array(INT16[0], np.float32),
        "high": np.array(INT16[1], np.float32),
        "axis": np.array([-2], np.int64),
        # sum((a - za) * w) = sum(a * w) - za * sum(w): MLAS adds the zero point's share apart.
        "zero_share": (activation_zero * w.sum(axis=0)).astype(np.float32),
        "scale": (activation_scale * constants[weight.input[1]]).astype(np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(v, t(key)) for key, v in values.items())
    has_bias = node.op_type == "Gemm" and len(node.input) == 3
    product = t("product") if has_bias else node.output[0]
    nodes = [
        helper.make_node("Cast", [activation.input[0]], [t("a")], to=TensorProto.FLOAT),
        helper.make_node("Reshape", [t("a"), t("shape")], [t("a_pairs")]),
        helper.make_node("Mul", [t("a_pairs"), t("w_pairs")], [t("products")]),
        helper.make_node("ReduceSum", [t("products"), t("axis")], [t("pair_sums")], keepdims=0),
        helper.make_node("Clip", [t("pair_sums"), t("low"), t("high")], [t("saturated")]),
        helper.make_node("ReduceSum", [t("saturated"), t("axis")], [t("sums")], keepdims=0),
        helper.make_node("Sub", [t("sums"), t("zero_share")], [t("centered")]),
        helper.make_node("Mul", [t("centered"), t("scale")], [product]),
    ]
    if has_bias:
        nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]]))
    return nodes
