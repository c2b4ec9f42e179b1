"""Small ONNX models built with onnx.helper for tests, and a helper that writes them into a model
repository (`<repo>/<name>/<version>/model.onnx` plus an optional `config.yaml`).

Every generator returns a checked `onnx.ModelProto` that ONNX Runtime 1.17+ loads (opset 17,
IR version 8). Dimension names (strings) are dynamic axes; ints are fixed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

# Every v2 datatype ONNX Runtime supports, with its ONNX element type and numpy dtype.
ONNX_TYPES: dict[str, int] = {
    "BOOL": TensorProto.BOOL,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}
DATATYPES: tuple[str, ...] = tuple(ONNX_TYPES)
NUMERIC_DATATYPES: tuple[str, ...] = tuple(d for d in DATATYPES if d != "BYTES")
NUMPY_TYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

Dims = Sequence[int | str]
OPSET = 17


def _finish(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def identity_model(
    datatype: str,
    dims: Dims = ("batch", 4),
    input_name: str = "INPUT0",
    output_name: str = "OUTPUT0",
) -> onnx.ModelProto:
    """`output_name` = `input_name` for one v2 datatype; by default a dynamic batch axis and 4
    columns."""
    elem = ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", [input_name], [output_name])],
        f"identity_{datatype.lower()}",
        [helper.make_tensor_value_info(input_name, elem, list(dims))],
        [helper.make_tensor_value_info(output_name, elem, list(dims))],
    )
    return _finish(graph)


def fixed_shape_model(datatype: str = "FP32", dims: Dims = (2, 3)) -> onnx.ModelProto:
    """An identity model with no dynamic axis at all (auto-complete gives max_batch_size 0)."""
    return identity_model(datatype, dims)


def add_sub_model(columns: int = 4) -> onnx.ModelProto:
    """Two FP32 inputs, two outputs: `SUM` = INPUT0 + INPUT1 and `DIFF` = INPUT0 - INPUT1, all
    [batch, columns]. For missing-input and `outputs` selection tests."""
    dims: list[int | str] = ["batch", columns]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["SUM"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["DIFF"]),
        ],
        "add_sub",
        [value("INPUT0", TensorProto.FLOAT, dims), value("INPUT1", TensorProto.FLOAT, dims)],
        [value("SUM", TensorProto.FLOAT, dims), value("DIFF", TensorProto.FLOAT, dims)],
    )
    return _finish(graph)


def write_model(
    repo_dir: Path,
    name: str,
    model_proto: onnx.ModelProto,
    config_yaml: str | None = None,
    version: int = 1,
) -> Path:
    """Save `model_proto` as `<repo_dir>/<name>/<version>/model.onnx` (and `config.yaml` when
    given); return the model file's path."""
    folder = repo_dir / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    path = folder / str(version) / "model.onnx"
    onnx.save(model_proto, path)
    if config_yaml is not None:
        (folder / "config.yaml").write_text(config_yaml)
    return path


def sample(datatype: str, shape: Sequence[int], seed: int = 0) -> np.ndarray:
    """Deterministic test data of `datatype` covering each type's extremes where it fits."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if datatype == "BYTES":
        words = ["", "a", "héllo", "日本", "x y", '"quoted"', "tab\t", "emoji 🙂"]
        array = np.empty(count, dtype=object)
        array[:] = [words[i % len(words)].encode() for i in range(count)]
        return array.reshape(shape)
    dtype = np.dtype(NUMPY_TYPES[datatype])
    if dtype.kind == "b":
        flags: np.ndarray = (np.arange(count) % 3 == 0).reshape(shape)
        return flags
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
        extremes = np.array([info.min, info.max, 0], dtype=dtype)[:count]
        values[: len(extremes)] = extremes
        return values.reshape(shape)
    values = (rng.standard_normal(count) * 100).astype(dtype)
    return values.reshape(shape)


def run_onnx(model_proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `model_proto` on `feed`, straight from an ONNX Runtime CPU session.
    BYTES inputs (object arrays of bytes) are decoded to str for ONNX Runtime, outputs stay str."""
    session = ort.InferenceSession(
        model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    ort_feed = {
        name: np.vectorize(bytes.decode, otypes=[object])(array)
        if array.dtype == object and array.size
        else array
        for name, array in feed.items()
    }
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, ort_feed), strict=True))


def model_name(datatype: str) -> str:
    """The repository name `write_datatype_models` gives the identity model of `datatype`."""
    return f"identity_{datatype.lower()}"


def write_datatype_models(
    repo_dir: Path, config_yaml: str | None = None
) -> dict[str, onnx.ModelProto]:
    """One identity model per datatype ([batch, 4], named by `model_name`) into `repo_dir`;
    returns the models by name so tests can run them directly."""
    models = {model_name(d): identity_model(d) for d in DATATYPES}
    for name, model in models.items():
        write_model(repo_dir, name, model, config_yaml)
    return models


SLEEPING_PY = """
import time


class Sleeping:
    def load(self, config):
        self.seconds = float(config["parameters"]["seconds"])

    def infer(self, inputs):
        time.sleep(self.seconds)
        return {"y": inputs["x"]}
"""


def write_sleeping_model(repo: Path, name: str = "slow", seconds: float = 0.4) -> Path:
    """A Python model (`allow_python_models`) whose every batch takes `seconds`: y = x, FP32
    [-1, 4], batches of up to 8. For tests that need a request to be running for a while."""
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLEEPING_PY)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 8\n"
        f"python:\n  parameters: {{seconds: {seconds}}}\n"
        "  inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
        "  outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n"
    )
    return folder
