"""engine/model_file.py: the inputs and outputs read from a model file's header, without loading
it, are those ONNX Runtime reports for the same file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine.backends.onnxruntime import _spec
from engine.demo import mlp_model
from engine.model_file import declared_specs, read_declared
from engine.types import TensorSpec
from tests.models import identity_model


def reported(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return (
        tuple(_spec(arg) for arg in session.get_inputs()),
        tuple(_spec(arg) for arg in session.get_outputs()),
    )


def initializer_as_input() -> onnx.ModelProto:
    """IR 3 style: the weight is also listed among the graph's inputs (not a model input)."""
    weight = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "old",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [weight],
        doc_string="a doc string, a varint-free field to skip",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "model",
    [
        mlp_model((64, 4096, 4)),
        identity_model("BYTES"),
        identity_model("FP16", dims=(2, 3)),
        identity_model("INT64", dims=("batch", "seq")),
        identity_model("BOOL", dims=(None, 4)),  # type: ignore[arg-type]
        initializer_as_input(),
    ],
    ids=["mlp", "bytes", "fixed", "symbolic", "unnamed", "initializer_input"],
)
def test_declared_specs_are_what_onnx_runtime_reports(tmp_path: Path, model: object) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(model, path)  # type: ignore[arg-type]
    inputs, outputs = declared_specs(path)
    assert (inputs, outputs) == reported(path)
    assert [s.dim_names for s in inputs] == [s.dim_names for s in reported(path)[0]]


class CountingFile(io.FileIO):
    """A model file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def test_the_weights_are_skipped_not_read(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(mlp_model((64, 65536, 4)), path)  # 16 MB of weights
    with CountingFile(path) as file:
        inputs, _ = read_declared(file, path.stat().st_size)
        assert [s.name for s in inputs] == ["x"]
        assert file.read_bytes < 4096  # a few hundred bytes of header, not the 16 MB


@pytest.mark.parametrize("content", [b"not an onnx model", b"", b"\x3a\xff\xff\xff\xff\x0f"])
def test_a_file_that_is_not_onnx_is_a_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError):  # noqa: PT011 - the message varies with the damage
        declared_specs(path)
