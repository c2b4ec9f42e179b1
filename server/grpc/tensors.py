"""ModelInferRequest -> InferRequest and InferResponse -> ModelInferResponse.

Inputs come either all in `raw_input_contents` (the binary layout of server/http/binary.py; decoded
zero-copy) or each in its typed `contents` field; outputs always go back in
`raw_output_contents`, as Triton answers and tritonclient reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from engine.datatypes import check_shape, numpy_dtype
from engine.errors import InvalidInput
from engine.regions import shared_tensor
from engine.types import InferRequest, InferResponse, ModelMetadata, SharedTensor, TensorSpec
from engine.validate import InputCheck, scheduling
from server.grpc.proto import grpc_service_pb2 as pb
from server.raw_tensors import tensor_buffer, tensor_from_buffer

__all__ = ["decode_request", "encode_response", "metadata_response", "parameters"]

InputTensor = pb.ModelInferRequest.InferInputTensor
_OutputTensor = pb.ModelInferResponse.InferOutputTensor
Parameter = pb.InferParameter | pb.ModelRepositoryParameter

# The typed contents field of each datatype and the numpy type protobuf hands it over as.
_CONTENTS: dict[str, tuple[str, type[np.generic]]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int32),
    "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint32),
    "UINT16": ("uint_contents", np.uint32),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", np.object_),
}


def parameters(params: Mapping[str, Parameter]) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> (or ModelRepositoryParameter) as plain Python
    values."""
    if not params:  # the usual case: no dict built, no loop run
        return {}
    out = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(param, which)
    return out


def _set_parameter(param: pb.InferParameter, value: object) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def _shape(tensor: InputTensor) -> tuple[int, ...]:
    return check_shape(tensor.name, list(tensor.shape))


def _typed(tensor: InputTensor, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    name = tensor.name
    used = [field.name for field, _ in tensor.contents.ListFields()]
    if datatype not in _CONTENTS:
        raise InvalidInput(
            f"input '{name}' is {datatype}, which has no typed contents field; "
            "send it in raw_input_contents"
        )
    field, wide = _CONTENTS[datatype]
    others = [used_field for used_field in used if used_field != field]
    if others:
        raise InvalidInput(
            f"input '{name}' is {datatype}, so its data goes in contents.{field}; "
            f"got contents.{', contents.'.join(others)}"
        )
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(
            f"input '{name}' has shape {list(shape)} ({count} elements) but contents.{field} "
            f"holds {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    received = np.array(values, dtype=wide)
    target = numpy_dtype(datatype)
    array = received.astype(target)
    if target != received.dtype and not np.array_equal(array, received):
        info = np.iinfo(target.type)  # type: ignore[type-var]
        bad = received[array != received][0]
        raise InvalidInput(
            f"input '{name}': value {bad} is out of range for {datatype} ({info.min} to {info.max})"
        )
    return array.reshape(shape)


def decode_request(request: pb.ModelInferRequest, check: InputCheck | None = None) -> InferRequest:
    """The engine's request for a ModelInferRequest; InvalidInput names what is malformed.
    `check` sees every input's declared shape and datatype before any array is built."""
    raw = request.raw_input_contents
    tensors = list(request.inputs)  # protobuf builds a wrapper per element at each iteration
    shapes: dict[str, tuple[int, ...]] = {}
    datatypes: dict[str, str] = {}
    shared: dict[str, SharedTensor] = {}
    for tensor in tensors:  # the metadata first: no array for a request that is refused
        name, datatype = tensor.name, tensor.datatype
        if name in shapes:
            raise InvalidInput(f"input '{name}' is given twice")
        try:
            numpy_dtype(datatype)
        except InvalidInput as exc:
            raise InvalidInput(f"input '{name}': {exc.message}") from None
        shapes[name], datatypes[name] = _shape(tensor), datatype
        if len(tensor.parameters):
            ref = shared_tensor(parameters(tensor.parameters), f"input '{name}'", shapes[name])
            if ref is not None:
                if tensor.HasField("contents"):
                    raise InvalidInput(
                        f"input '{name}' names a shared memory region and has "
                        "contents too; send one"
                    )
                shared[name] = ref
                continue
        if raw and tensor.HasField("contents"):
            raise InvalidInput(f"input '{name}' has both contents and raw_input_contents")
    # Inputs in shared memory have no raw contents (tritonclient sends none for them).
    if raw and len(raw) != len(tensors) - len(shared):
        raise InvalidInput(
            f"request has {len(tensors) - len(shared)} inputs outside shared memory but "
            f"{len(raw)} raw_input_contents entries; send raw contents for every such input or "
            "for none"
        )
    if check is not None:
        check(shapes, datatypes)
    inputs: dict[str, np.ndarray] = {}
    index = 0
    for tensor in tensors:
        name, datatype, shape = tensor.name, tensor.datatype, shapes[tensor.name]
        if name in shared:
            continue
        if raw:
            buffer = memoryview(raw[index])
            inputs[name] = tensor_from_buffer(buffer, datatype, shape, name, shape_checked=True)
            index += 1
        else:
            inputs[name] = _typed(tensor, datatype, shape)
    outputs = []
    shared_outputs: dict[str, SharedTensor] = {}
    for output in request.outputs if len(request.outputs) else ():  # len: no iterator built
        output_params = parameters(output.parameters)
        if "classification" in output_params:
            raise InvalidInput(
                f"output '{output.name}': the classification extension is not supported"
            )
        ref = shared_tensor(output_params, f"output '{output.name}'") if output_params else None
        if ref is not None:
            shared_outputs[output.name] = ref
        outputs.append(output.name)
    params = parameters(request.parameters)
    priority, timeout_s = scheduling(params)
    return InferRequest(
        model_name=request.model_name,
        model_version=request.model_version or None,
        inputs=inputs,
        datatypes=datatypes,
        id=request.id or None,
        outputs=outputs or None,
        parameters=params,
        priority=priority,
        timeout_s=timeout_s,
        shared_inputs=shared or None,
        shared_outputs=shared_outputs or None,
    )


def metadata_response(meta: ModelMetadata) -> pb.ModelMetadataResponse:
    """The ModelMetadataResponse for a model's metadata."""

    def tensors(specs: Iterable[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=s.name, datatype=s.datatype, shape=list(s.shape)
            )
            for s in specs
        ]

    return pb.ModelMetadataResponse(
        name=meta.name,
        versions=list(meta.versions),
        platform=meta.platform,
        inputs=tensors(meta.inputs),
        outputs=tensors(meta.outputs),
    )


def encode_response(response: InferResponse) -> pb.ModelInferResponse:
    """The ModelInferResponse for an engine response, outputs in raw_output_contents."""
    outputs, raw = [], []
    datatypes = response.datatypes
    shared = response.shared_outputs or {}
    for name, array in response.outputs.items():
        datatype = datatypes[name]
        output = _OutputTensor(name=name, datatype=datatype, shape=array.shape)
        outputs.append(output)
        ref = shared.get(name)
        if ref is None:
            raw.append(bytes(tensor_buffer(array, datatype)))
        else:  # in the client's region; an empty entry keeps the others at their index
            raw.append(b"")
            _set_parameter(output.parameters["shared_memory_region"], ref.region)
            _set_parameter(output.parameters["shared_memory_byte_size"], ref.byte_size)
            if ref.offset:
                _set_parameter(output.parameters["shared_memory_offset"], ref.offset)
    # Built in one constructor call: upb fills repeated fields from lists faster than add().
    message = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id or "",
        outputs=outputs,
        raw_output_contents=raw,
    )
    for key, value in response.parameters.items():
        _set_parameter(message.parameters[key], value)
    return message
