"""JSON tensors of the Open Inference Protocol: request decoding and response encoding.

A request's structure is read and checked here (its fields, each input's header, the small-body
fast path `simple_request`); each input's JSON `data` is made an array by `json_arrays`."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from engine import datatypes
from engine.errors import InvalidInput
from engine.regions import shared_tensor
from engine.types import InferRequest, SharedTensor
from engine.validate import InputCheck, check_parameters, scheduling
from server.http.json_arrays import TYPES, decode_data


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidInput saying what is wrong with it."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON in request body: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(payload).__name__}")
    return payload


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise InvalidInput(f"{where}: missing field '{key}'")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidInput(f"{where}: field '{key}' must be {names}, got {value!r:.60}")
    return value


def tensor_header(item: Any, index: int) -> tuple[str, str, list[int], dict[str, Any]]:
    """Name, datatype, shape and parameters of one `inputs` entry, all checked."""
    if not isinstance(item, dict):
        raise InvalidInput(f"inputs[{index}] must be an object, got {type(item).__name__}")
    name = _field(item, "name", str, f"inputs[{index}]")
    where = f"input '{name}'"
    datatype = _field(item, "datatype", str, where)
    try:
        datatypes.numpy_dtype(datatype)
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc.message}") from None
    shape = list(datatypes.check_shape(name, _field(item, "shape", list, where)))
    parameters = {} if item.get("parameters") is None else item["parameters"]
    if not isinstance(parameters, dict):
        raise InvalidInput(f"{where}: parameters must be an object")
    check_parameters(parameters, where)
    return name, datatype, shape, parameters


TensorHeader = tuple[str, str, list[int], dict[str, Any]]
"""An input's name, datatype, shape and parameters, as `tensor_header` read and checked them."""


def tensor_headers(payload: dict[str, Any]) -> list[TensorHeader]:
    """Every `inputs` entry's header, checked (`tensor_header`), in order; InvalidInput for a
    missing or empty `inputs` and for an input given twice."""
    inputs_json = _field(payload, "inputs", list, "request")
    if not inputs_json:
        raise InvalidInput("request: 'inputs' is empty")
    headers: list[TensorHeader] = []
    names: set[str] = set()
    for index, item in enumerate(inputs_json):
        header = tensor_header(item, index)
        if header[0] in names:
            raise InvalidInput(f"input '{header[0]}' is given twice")
        names.add(header[0])
        headers.append(header)
    return headers


def check_header(payload: dict[str, Any], check: InputCheck) -> list[TensorHeader]:
    """Every input's name, datatype and shape, read from the request and passed to `check`
    before any tensor data is decoded: a request the model refuses costs no tensor memory. The
    headers are returned for `decode_request`, which then need not read them again."""
    headers = tensor_headers(payload)
    check({h[0]: h[2] for h in headers}, {h[0]: h[1] for h in headers})
    return headers


SIMPLE_KEYS = frozenset({"name", "datatype", "shape", "data"})
"""The fields of an input that `simple_request` decodes: all of them, nothing else."""


def _bounds(dtype: np.dtype[Any]) -> tuple[float, float]:
    if dtype.kind == "f":
        return float(np.finfo(dtype.str).min), float(np.finfo(dtype.str).max)
    return int(np.iinfo(dtype.str).min), int(np.iinfo(dtype.str).max)  # exact: 2^64 - 1 too


_SIMPLE = {
    name: (dtype, *_bounds(dtype))
    for name, dtype in datatypes.NUMPY_DTYPES.items()
    if dtype.kind in "iuf"
}
"""The datatypes `simple_request` decodes: each one's numpy dtype and least and greatest value."""


def simple_request(
    payload: dict[str, Any], model_name: str, model_version: str | None, check: InputCheck
) -> InferRequest | None:
    """The request that `check_header` and `decode_request` make of a body in the common shape,
    or None for any other body, which they then decode or refuse, naming its problem.

    The common shape: `inputs` and maybe a string `id`, nothing else; each input exactly a name,
    a numeric datatype, a shape of whole numbers and flat `data` of as many plain numbers (no
    bools), each within the datatype's range. Each of these checks is one pass in C over a
    field (the set of its values' types, its min and max), where the general path's layers of
    helpers cost a small body's request more than the rest of its front-end work together. The
    same `check` runs on the same declared shapes, so a refused request gets the same error."""
    items, request_id = payload.get("inputs"), payload.get("id")
    if (
        not payload.keys() <= {"inputs", "id"}
        or type(items) is not list
        or not items
        or not (request_id is None or type(request_id) is str)
    ):
        return None
    shapes: dict[str, list[int]] = {}
    types: dict[str, str] = {}
    for item in items:
        if type(item) is not dict or item.keys() != SIMPLE_KEYS:
            return None
        name, datatype, shape, data = item["name"], item["datatype"], item["shape"], item["data"]
        if (
            type(name) is not str
            or name in shapes
            or datatype not in _SIMPLE
            or type(shape) is not list
            or len(shape) > datatypes.MAX_DIMS
            or (shape and (set(map(type, shape)) != {int} or min(shape) < 0))
            or type(data) is not list
            or not data
            or len(data) != math.prod(shape)
        ):
            return None
        shapes[name], types[name] = shape, datatype
    check(shapes, types)
    inputs: dict[str, np.ndarray] = {}
    for item in items:
        name, data = item["name"], item["data"]
        dtype, least, greatest = _SIMPLE[types[name]]
        if (
            not set(map(type, data)) <= TYPES[dtype.kind]
            or min(data) < least
            or max(data) > greatest
        ):
            return None
        inputs[name] = np.array(data, dtype=dtype).reshape(shapes[name])
    return InferRequest(model_name, inputs, types, model_version, request_id)


def decode_request(
    payload: dict[str, Any],
    model_name: str,
    model_version: str | None,
    arrays: dict[str, np.ndarray] | None = None,
    headers: list[TensorHeader] | None = None,
) -> InferRequest:
    """An InferRequest from a v2 JSON body. `arrays` holds inputs already decoded elsewhere
    (binary tensor data), by name; every other input must carry JSON `data`. `headers` are the
    inputs' headers as `check_header` returned them for this payload (else they are read here)."""
    if headers is None:
        headers = tensor_headers(payload)
    arrays = arrays or {}
    inputs: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    shared: dict[str, SharedTensor] = {}
    for (name, datatype, shape, params), item in zip(headers, payload["inputs"], strict=True):
        types[name] = datatype
        ref = shared_tensor(params, f"input '{name}'", tuple(shape)) if params else None
        if ref is not None:
            if "data" in item or name in arrays:
                raise InvalidInput(
                    f"input '{name}' names a shared memory region and sends data too; send one"
                )
            shared[name] = ref
        elif name in arrays:
            inputs[name] = arrays[name]
        else:
            if "data" not in item:
                raise InvalidInput(f"input '{name}': missing field 'data'")
            inputs[name] = decode_data(name, datatype, shape, item["data"])
    outputs = None
    shared_outputs: dict[str, SharedTensor] = {}
    if payload.get("outputs") is not None:
        outputs_json = _field(payload, "outputs", list, "request")
        outputs = [_output_name(o, i, shared_outputs) for i, o in enumerate(outputs_json)]
    parameters = {} if payload.get("parameters") is None else payload["parameters"]
    if not isinstance(parameters, dict):
        raise InvalidInput("request: 'parameters' must be an object")
    check_parameters(parameters, "request")
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f"request: 'id' must be a string, got {request_id!r:.60}")
    priority, timeout_s = scheduling(parameters)
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        datatypes=types,
        id=request_id,
        outputs=outputs,
        parameters=parameters,
        priority=priority,
        timeout_s=timeout_s,
        shared_inputs=shared or None,
        shared_outputs=shared_outputs or None,
    )


def _output_name(item: Any, index: int, shared: dict[str, SharedTensor]) -> str:
    """A requested output's name; a shared-memory region it names goes into `shared`."""
    name: str = _field(item if isinstance(item, dict) else {}, "name", str, f"outputs[{index}]")
    parameters = item.get("parameters")
    if isinstance(parameters, dict):  # any other kind is refused by the binary extension's reader
        check_parameters(parameters, f"output '{name}'")
        ref = shared_tensor(parameters, f"output '{name}'")
        if ref is not None:
            shared[name] = ref
    return name


SUMMED_FINITE = 32
"""Up to this many values, `_finite` sums them as Python floats: a sum is finite exactly when
every value is (no 32 half or single floats can overflow a double; float64 values near its
largest may, and then take the exact path, which writes them too), at 0.2 µs against numpy's
1 µs for a small output."""


def _finite(data: np.ndarray) -> bool:
    """Whether every value of the flat float array `data` is finite."""
    if data.size <= SUMMED_FINITE:
        return math.isfinite(sum(data.tolist()))
    return bool(np.isfinite(data).all())


def json_data(array: np.ndarray, datatype: str) -> Any:
    """An output tensor's flat v2 JSON `data` (BYTES as text; FP16 widened, JSON has no half)."""
    if datatype == "BYTES":
        return [
            v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.ravel()
        ]
    data = np.ascontiguousarray(array).ravel()
    if data.dtype.kind == "f" and not _finite(data):
        # JSON has no NaN or infinities (orjson writes null, losing them and their signs):
        # written as Triton writes them, the tokens tritonclient's json.loads reads back.
        return orjson.Fragment(json.dumps(data.tolist(), allow_nan=True))
    return data.astype(np.float32) if data.dtype == np.float16 else data
