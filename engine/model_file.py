"""A model.onnx file's declared inputs and outputs, read without loading the model: for the metadata
of a model not loaded yet (`on_demand` mode), which must not cost the model's memory.

`onnx.load` would parse the whole file, weights included (a transient copy as large as the
file, outside any budget), so this walks the protobuf's wire format instead: it reads the
graph's `input` and `output` entries (a few hundred bytes each) and the names of its
initializers, and seeks past everything else (nodes' and initializers' data). The specs are
those ONNX Runtime reports for the same file: graph inputs that are not initializers, dynamic
or symbolic axes as -1 with their names kept."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from engine import datatypes
from engine.types import TensorSpec

# Field numbers of onnx.proto: ModelProto.graph; GraphProto.initializer, input, output;
# TensorProto.name.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _TENSOR_NAME = 7, 5, 11, 12, 8
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def declared_specs(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The model's (inputs, outputs), as ONNX Runtime would report them (blocking: file I/O).
    ValueError for a file that is not an ONNX model or a datatype the protocol lacks."""
    with path.open("rb") as file:
        return read_declared(file, path.stat().st_size)


def read_declared(
    file: BinaryIO, size: int
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """`declared_specs` of an open model file of `size` bytes, which it reads and seeks."""
    from onnx import ValueInfoProto

    inputs: list[bytes] = []
    outputs: list[bytes] = []
    initializers: set[str] = set()
    graph = _find(file, _MODEL_GRAPH, size)
    if graph is None:
        raise ValueError("no ONNX graph in the file")
    for field, length in _Walk(file, file.tell() + graph):
        if field in (_GRAPH_INPUT, _GRAPH_OUTPUT):
            (inputs if field == _GRAPH_INPUT else outputs).append(file.read(length))
        elif field == _GRAPH_INITIALIZER:
            end = file.tell() + length
            name = _find(file, _TENSOR_NAME, end)
            if name is not None:
                initializers.add(file.read(name).decode())
            file.seek(end)
        else:
            file.seek(length, 1)
    specs = [
        [_spec(ValueInfoProto.FromString(raw)) for raw in group] for group in (inputs, outputs)
    ]
    return tuple(s for s in specs[0] if s.name not in initializers), tuple(specs[1])


def _spec(info: object) -> TensorSpec:
    from onnx import TensorProto

    tensor = info.type.tensor_type  # type: ignore[attr-defined]
    type_name = TensorProto.DataType.Name(tensor.elem_type).lower()
    dims = list(tensor.shape.dim)
    shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else -1 for d in dims)
    names = tuple(d.dim_param or None for d in dims)
    name: str = info.name  # type: ignore[attr-defined]
    return TensorSpec(name, datatypes.from_onnx(f"tensor({type_name})"), shape, names)


def _varint(file: BinaryIO) -> int:
    value, shift = 0, 0
    while True:
        byte = file.read(1)
        if not byte:
            raise ValueError("truncated ONNX file")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("not an ONNX file (bad varint)")


class _Walk:
    """The length-delimited fields of one message, as (field number, size), the file positioned
    at each field's data; other wire types are skipped here. The caller reads or seeks past
    each field's data before taking the next."""

    def __init__(self, file: BinaryIO, end: int) -> None:
        self._file, self._end = file, end

    def __iter__(self) -> _Walk:
        return self

    def __next__(self) -> tuple[int, int]:
        file = self._file
        while file.tell() < self._end:
            key = _varint(file)
            field, wire = key >> 3, key & 7
            if wire == _LENGTH:
                return field, _varint(file)
            if wire == _VARINT:
                _varint(file)
            elif wire in (_FIXED64, _FIXED32):
                file.seek(8 if wire == _FIXED64 else 4, 1)
            else:
                raise ValueError(f"not an ONNX file (wire type {wire})")
        raise StopIteration


def _find(file: BinaryIO, wanted: int, end: int) -> int | None:
    """Position the file at the data of the first length-delimited field `wanted` before `end`
    and return its size, or None."""
    for field, size in _Walk(file, end):
        if field == wanted:
            return size
        file.seek(size, 1)
    return None
