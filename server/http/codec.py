"""JSON tensors of the Open Inference Protocol: request decoding and response encoding."""

from __future__ import annotations

import array
import functools
import itertools
import json
import math
import struct
from typing import Any

import numpy as np
import orjson

from engine import datatypes
from engine.errors import InvalidInput
from engine.types import InferRequest
from engine.validate import InputCheck, check_parameters, scheduling
from server.http.json_header import NumberKind, RawData

# Which numpy kinds a JSON array may decode to for each family of datatypes.
_TYPES: dict[str, set[type]] = {"b": {bool}, "u": {int}, "i": {int}, "f": {int, float}}
_KIND_NAMES = {str: "text", bool: "a boolean", float: "a fraction", int: "an integer",
               dict: "an object", type(None): "null"}  # fmt: skip
_NEEDS = {"b": "booleans", "u": "integers", "i": "integers", "f": "numbers"}
_KIND_DTYPES = {"d": np.dtype(np.float64), "i": np.dtype(np.int64), "u": np.dtype(np.uint64)}
"""The numpy dtype of each kind of C number RawData.numbers reads."""
_FLOAT_MAX = {size: float(np.finfo(f"f{size}").max) for size in (2, 4, 8)}
"""The largest finite value of each float width, by its size in bytes."""


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
    if "shared_memory_region" in parameters:
        raise InvalidInput(f"{where}: shared memory is not supported by this server")
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


def decode_data(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """A JSON `data` field (flat or nested, or RawData still to parse) as an array of `shape`;
    every value is type- and range-checked, so nothing is silently coerced (no bools as
    numbers, no overflow to inf).

    The same array, or the same InvalidInput, as `walk_data`, without a Python step per value
    (`vectorized_data`); data those checks cannot vouch for is handed to `walk_data`, which
    names the problem."""
    if isinstance(data, RawData):
        decoded = raw_numbers(datatype, shape, data)
        if decoded is not None:
            return decoded
        data = data.parse()
    decoded = vectorized_data(datatype, shape, data) if isinstance(data, list) else None
    return walk_data(name, datatype, shape, data) if decoded is None else decoded


def raw_numbers(datatype: str, shape: list[int], data: RawData) -> np.ndarray | None:
    """Numeric `data` still in the body's text as `walk_data` decodes it, read straight into C
    numbers (RawData.numbers), or None when only the parsed values can say."""
    target = datatypes.NUMPY_DTYPES.get(datatype)
    if target is None or target.kind not in "iuf":
        return None
    kind: NumberKind = "d" if target.kind == "f" else "u" if target == np.uint64 else "i"
    buffer = data.numbers(kind)
    if buffer is None:
        return None
    values = np.frombuffer(buffer, dtype=_KIND_DTYPES[kind])
    return _narrowed(values, target, shape) if values.size == math.prod(shape) else None


def vectorized_data(datatype: str, shape: list[int], data: list[Any]) -> np.ndarray | None:
    """Numeric `data` as `walk_data` decodes it, or None when only `walk_data` can say.

    Nested lists are checked and flattened a level at a time. The values are read into C 64-bit
    numbers by `struct` (`_packed`), which refuses text, null, objects and lists (and fractions,
    for an integer datatype) and numbers that do not fit. It takes bools as 1 and 0, so only the
    values read as 0 or 1 are looked at again. Ranges and the overflow of a cast to a narrower
    float are checked on the numpy array. BOOL data is left to the walk."""
    target = datatypes.NUMPY_DTYPES.get(datatype)
    if target is None or target.kind not in "iuf":
        return None
    flat = _flat_values(data)
    if flat is None or len(flat) != math.prod(shape):
        return None
    code = "d" if target.kind == "f" else "Q" if target == np.uint64 else "q"
    try:
        values = np.frombuffer(_packed(code, flat), dtype=code)
    except (TypeError, OverflowError, struct.error):
        return None
    if _holds_bool(flat, values):
        return None
    return _narrowed(values, target, shape)


def _narrowed(values: np.ndarray, target: np.dtype[Any], shape: list[int]) -> np.ndarray | None:
    """64-bit `values` cast to `target` in `shape`, or None when one does not fit it."""
    if target.kind in "iu":
        info = np.iinfo(target.str)
        if values.size and (values.min() < info.min or values.max() > info.max):
            return None
        return values.astype(target).reshape(shape)
    # One check covers NaN, inf and a double too large for a narrower type, before the cast, so
    # the cast cannot overflow (numpy's errstate, to silence it, costs more than this check). A
    # NaN is the max (and the min): no comparison holds for it. Two reductions, no abs() array.
    bound = _FLOAT_MAX[target.itemsize]
    if values.size and not (values.max() <= bound and values.min() >= -bound):
        return None
    return values.astype(target).reshape(shape)


STRUCT_VALUES = 1 << 16
"""Up to this many values are read by one `struct.pack` call, past it by `array.array`."""


def _packed(code: str, flat: list[Any]) -> bytes | array.array[Any]:
    """`flat` as C numbers of type `code` ("d", "q" or "Q"). struct reads the values faster than
    array.array, which parses each one as a call's argument (`json_cost`'s `decode_data` column
    for the CNN's 12,288 values: 143 µs with array, the run before struct; 68-72 µs since), but
    it takes the values as the call's arguments: past STRUCT_VALUES, array."""
    if len(flat) > STRUCT_VALUES:
        return array.array(code, flat)
    return _struct(code, len(flat)).pack(*flat)


@functools.lru_cache(maxsize=256)
def _struct(code: str, count: int) -> struct.Struct:
    return struct.Struct(f"={count}{code}")


def _flat_values(data: list[Any]) -> list[Any] | None:
    """The values of regularly nested lists in row-major order; None when the lists at one
    depth differ in length or mix with values, or nest deeper than any shape."""
    items = data
    for _ in range(datatypes.MAX_DIMS):
        if not items or type(items[0]) is not list:
            return items  # a list among these values is refused by array.array
        if set(map(type, items)) != {list} or len(set(map(len, items))) != 1:
            return None
        items = list(itertools.chain.from_iterable(items))
    return None


_SCAN_BELOW = 128
"""Fewer values than this are scanned for bools one by one: cheaper than numpy's calls."""


def _holds_bool(flat: list[Any], values: np.ndarray) -> bool:
    """Whether a JSON `true` or `false` is among the values, read as 1 and 0 in `values`."""
    if len(flat) < _SCAN_BELOW:
        return bool in set(map(type, flat))
    suspects = np.flatnonzero((values == 0) | (values == 1)).tolist()
    return bool in set(map(type, map(flat.__getitem__, suspects)))


def walk_data(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """`decode_data` by a walk over every value in Python: the reference that `decode_data` is
    tested against, and the decoder of the data its checks cannot vouch for, whose InvalidInput
    names the problem (the first value of a wrong kind or out of range, the raggedness, the
    count against the shape)."""
    where = f"input '{name}'"
    flat = _flatten(where, data) if isinstance(data, list) else [data]
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInput(f"{where}: shape {shape} needs {count} values, data has {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            bad = next(v for v in flat if not isinstance(v, str))
            raise InvalidInput(f"{where}: BYTES data must be strings, got {bad!r:.40}")
        array = np.empty(count, dtype=object)
        array[:] = [v.encode("utf-8") for v in flat]
    else:
        array = _numbers(where, datatype, flat)
    return array.reshape(shape)


def _numbers(where: str, datatype: str, flat: list[Any]) -> np.ndarray:
    target = datatypes.numpy_dtype(datatype)
    allowed = _TYPES[target.kind]
    if not set(map(type, flat)) <= allowed:
        bad = next(v for v in flat if type(v) not in allowed)
        if target.kind in "iu" and datatypes.past_64_bits(bad):  # out of range, not a fraction
            info = np.iinfo(target.str)
            raise InvalidInput(
                f"{where}: value {datatypes.shown(bad)} is out of range for {datatype} "
                f"({info.min} to {info.max})"
            )
        raise InvalidInput(
            f"{where}: data holds {_KIND_NAMES.get(type(bad), type(bad).__name__)}; datatype "
            f"{datatype} needs {_NEEDS[target.kind]} (got {bad!r:.40})"
        )
    try:
        if target.kind == "f" and target.itemsize < 8:  # a double may not fit: inf, checked below
            with np.errstate(over="ignore"):
                array = np.array(flat, dtype=target)
        else:
            array = np.array(flat, dtype=target)
    except OverflowError:
        info = np.iinfo(target.str)
        bad = next(v for v in flat if not info.min <= v <= info.max)
        raise InvalidInput(
            f"{where}: value {bad} is out of range for {datatype} ({info.min} to {info.max})"
        ) from None
    # JSON has no inf or NaN, so a non-finite value here is an overflow of the cast.
    if target.kind == "f" and array.size and not np.isfinite(array).all():
        bad = flat[int(np.flatnonzero(~np.isfinite(array))[0])]
        limit = float(np.finfo(target.str).max)
        raise InvalidInput(
            f"{where}: value {bad} is out of range for {datatype} (magnitude at most {limit:.6g})"
        )
    return array


def _flatten(where: str, data: list[Any], depth: int = 0) -> list[Any]:
    """Nested lists flattened in row-major order; InvalidInput if they are ragged (lists of
    different lengths, or lists and values mixed, at one depth) or deeper than any shape."""
    if depth > datatypes.MAX_DIMS:
        raise InvalidInput(f"{where}: data is nested deeper than {datatypes.MAX_DIMS} levels")
    if not data or not isinstance(data[0], list):
        if list in set(map(type, data)):
            raise InvalidInput(f"{where}: data is a ragged nested list")
        return data
    out: list[Any] = []
    for item in data:
        if not isinstance(item, list) or len(item) != len(data[0]):
            raise InvalidInput(f"{where}: data is a ragged nested list")
        out.extend(_flatten(where, item, depth + 1))
    return out


SIMPLE_KEYS = frozenset({"name", "datatype", "shape", "data"})
"""The fields of an input that `simple_request` decodes: all of them, nothing else."""


def _bounds(dtype: np.dtype[Any]) -> tuple[float, float]:
    if dtype.kind == "f":
        return float(np.finfo(dtype.str).min), float(np.finfo(dtype.str).max)
    return int(np.iinfo(dtype.str).min), int(np.iinfo(dtype.str).max)  # exact: 2^64 - 1 too


_SIMPLE = {name: (dtype, *_bounds(dtype)) for name, dtype in datatypes.NUMPY_DTYPES.items()
           if dtype.kind in "iuf"}  # fmt: skip
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
            not set(map(type, data)) <= _TYPES[dtype.kind]
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
    for (name, datatype, shape, _), item in zip(headers, payload["inputs"], strict=True):
        if name in arrays:
            inputs[name] = arrays[name]
        else:
            if "data" not in item:
                raise InvalidInput(f"input '{name}': missing field 'data'")
            inputs[name] = decode_data(name, datatype, shape, item["data"])
        types[name] = datatype
    outputs = None
    if payload.get("outputs") is not None:
        outputs_json = _field(payload, "outputs", list, "request")
        outputs = [_output_name(o, i) for i, o in enumerate(outputs_json)]
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
    )


def _output_name(item: Any, index: int) -> str:
    name: str = _field(item if isinstance(item, dict) else {}, "name", str, f"outputs[{index}]")
    parameters = item.get("parameters")
    if isinstance(parameters, dict):  # any other kind is refused by the binary extension's reader
        check_parameters(parameters, f"output '{name}'")
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
