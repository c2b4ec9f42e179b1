"""JSON tensors: request decoding (its structure, every kind of wrong field, the common shape's
own decoder against the general path) and response encoding, with a Hypothesis round trip
decode(encode(x)) == x. Decoding each input's `data` is tested in test_json_arrays."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.errors import InvalidInput
from engine.types import InferRequest, InferResponse, SharedTensor
from server.http import binary, codec
from server.http.codec import decode_request, json_data, parse_json, simple_request
from server.http.json_arrays import decode_data
from tests.models import NUMERIC_DATATYPES, NUMPY_TYPES, sample


def body(**overrides: Any) -> dict[str, Any]:
    """A valid request body with one FP32 input 'x' of shape [2, 2]."""
    tensor = {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}
    return {"inputs": [tensor], **overrides}


def tensor(**fields: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0], **fields}]}


def rejected(payload: Any) -> str:
    with pytest.raises(InvalidInput) as caught:
        decode_request(payload, "m", None)
    return caught.value.message


def to_json(array: np.ndarray, datatype: str) -> Any:
    """What a client sends: flat JSON values, through a real JSON encoder and parser."""
    data = json_data(array, datatype)
    return orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY))


# -- parse_json ------------------------------------------------------------------------------


def test_parse_json_object() -> None:
    assert parse_json(b'{"inputs": []}') == {"inputs": []}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{", "malformed JSON"),
        (b'{"inputs": [1,]}', "malformed JSON"),
        (b"\xff\xfe{}", "malformed JSON"),
        (b'{"a": NaN}', "malformed JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'"text"', "must be a JSON object, got str"),
        (b"null", "must be a JSON object, got NoneType"),
    ],
)
def test_parse_json_rejects(raw: bytes, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        parse_json(raw)


# -- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[-1, 4], [2, -3]])
def test_negative_dims_are_rejected(shape: list[int]) -> None:
    message = rejected(tensor(shape=shape))
    assert message == f"input 'x': shape must be a list of non-negative integers, got {shape}"


@pytest.mark.parametrize("shape", [[1.0], [True], ["1"], [None], [[1]]])
def test_non_integer_dims_are_rejected(shape: list[Any]) -> None:
    assert "shape must be a list of non-negative integers" in rejected(tensor(shape=shape))


@pytest.mark.parametrize(
    "shape",
    [
        [1] * 65,  # numpy holds at most 64 dimensions
        [0, 2**70],  # 0 values, but no array can have this shape
        [0, 2**62, 2**62],
        [0, 2**61],  # within int64, but 2**61 elements of 8 bytes are not
        [2**60, 0],
        [0, 2**30, 2**30],
    ],
)
def test_shapes_numpy_cannot_hold_are_invalid_input(shape: list[int]) -> None:
    count = int(np.prod(shape, dtype=object))
    data = [1.0] * count
    for datatype in ("FP32", "FP64", "BYTES"):
        values = ["a"] * count if datatype == "BYTES" else data
        message = rejected(tensor(shape=shape, datatype=datatype, data=values))
        assert message.startswith("input 'x': shape "), message


# -- request structure ------------------------------------------------------------------------


def test_decode_request_fields() -> None:
    request = decode_request(
        body(id="req-7", outputs=[{"name": "y"}], parameters={"priority": 2, "tag": "t"}),
        "m",
        "3",
    )
    assert (request.model_name, request.model_version, request.id) == ("m", "3", "req-7")
    assert request.datatypes == {"x": "FP32"}
    assert request.inputs["x"].tolist() == [[1, 2], [3, 4]]
    assert request.outputs == ["y"]
    assert request.parameters == {"priority": 2, "tag": "t"}
    assert request.priority == 2
    assert request.timeout_s is None


def test_timeout_parameter_is_microseconds() -> None:
    assert decode_request(body(parameters={"timeout": 1_500_000}), "m", None).timeout_s == 1.5
    assert decode_request(body(parameters={"timeout": 250}), "m", None).timeout_s == 0.00025
    assert decode_request(body(parameters={"timeout": 0}), "m", None).timeout_s is None


@pytest.mark.parametrize("key", ["timeout", "priority"])
@pytest.mark.parametrize("value", [-1, 1.5, "10", True, [1]])
def test_bad_timeout_and_priority(key: str, value: Any) -> None:
    message = rejected(body(parameters={key: value}))
    assert message.startswith(f"parameter '{key}' must be a non-negative integer")


@pytest.mark.parametrize("key", ["timeout", "priority"])
def test_timeout_and_priority_past_64_bits_are_out_of_range(key: str) -> None:
    # The body as a client sends it: the parser reads 2**64 as the double 1.8446744073709552e+19.
    payload = orjson.loads(json.dumps(body(parameters={key: 2**64})))
    message = f"parameter '{key}' is out of range (0 to {2**64 - 1}), got 2^64 or more"
    assert rejected(payload) == message


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({}, "request: missing field 'inputs'"),
        ({"inputs": {}}, "field 'inputs' must be list"),
        ({"inputs": []}, "'inputs' is empty"),
        ({"inputs": [5]}, "inputs[0] must be an object, got int"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]},
         "inputs[0]: missing field 'name'"),
        ({"inputs": [{"name": 5, "datatype": "FP32", "shape": [1], "data": [1]}]},
         "inputs[0]: field 'name' must be str"),
        ({"inputs": [{"name": "x", "shape": [1], "data": [1]}]},
         "input 'x': missing field 'datatype'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]},
         "input 'x': missing field 'shape'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]},
         "input 'x': missing field 'data'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": "1", "data": [1]}]},
         "input 'x': field 'shape' must be list"),
        (tensor(datatype="FLOAT"), "unknown datatype 'FLOAT'; allowed: BOOL"),
        (tensor(datatype=32), "field 'datatype' must be str"),
        (body(outputs={"name": "y"}), "field 'outputs' must be list"),
        (body(outputs=["y"]), "outputs[0]: missing field 'name'"),
        (body(outputs=[{"name": 3}]), "outputs[0]: field 'name' must be str"),
    ],
)  # fmt: skip
def test_missing_and_mistyped_fields(payload: dict[str, Any], fragment: str) -> None:
    assert fragment in rejected(payload)


def test_duplicate_input_is_rejected() -> None:
    payload = body()
    payload["inputs"] = payload["inputs"] * 2
    assert rejected(payload) == "input 'x' is given twice"


@pytest.mark.parametrize("request_id", [5, 1.5, True, ["a"], {"a": 1}])
def test_bad_id_is_rejected(request_id: Any) -> None:
    assert rejected(body(id=request_id)).startswith("request: 'id' must be a string")


@pytest.mark.parametrize("parameters", ["x", 5, [1], [], 0, False, ""])
def test_bad_request_parameters_are_rejected(parameters: Any) -> None:
    assert "'parameters' must be an object" in rejected(body(parameters=parameters))


@pytest.mark.parametrize("parameters", ["x", 5, [1], [], 0, False])
def test_bad_input_parameters_are_rejected(parameters: Any) -> None:
    assert rejected(tensor(parameters=parameters)) == "input 'x': parameters must be an object"


def nested(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [33, 500, 1000])
def test_parameters_nested_too_deep_are_rejected(depth: int) -> None:
    limit = "nested deeper than 32 levels"
    assert rejected(body(parameters={"p": nested(depth)})) == (f"request: parameter 'p' is {limit}")
    assert (
        rejected(tensor(parameters={"p": nested(depth)})) == f"input 'x': parameter 'p' is {limit}"
    )
    payload = body(outputs=[{"name": "y", "parameters": {"p": nested(depth)}}])
    assert rejected(payload) == f"output 'y': parameter 'p' is {limit}"


def test_parameters_nested_up_to_the_limit_are_kept() -> None:
    request = decode_request(body(parameters={"p": nested(32)}), "m", None)
    assert request.parameters == {"p": nested(32)}


def test_shared_memory_input_with_data_is_rejected() -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 16}
    assert rejected(tensor(parameters=params)) == (
        "input 'x' names a shared memory region and sends data too; send one"
    )


def test_inputs_and_outputs_in_shared_memory_are_named_not_decoded() -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 32, "shared_memory_offset": 8}
    payload = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "parameters": params}],
        "outputs": [
            {
                "name": "y",
                "parameters": {"shared_memory_region": "o", "shared_memory_byte_size": 4},
            },
            {"name": "z"},
        ],
    }
    request = decode_request(payload, "m", None)
    assert request.inputs == {}
    assert request.datatypes == {"x": "FP32"}
    assert request.shared_inputs == {"x": SharedTensor("r", 8, 32, (2, 4))}
    assert request.outputs == ["y", "z"]
    assert request.shared_outputs == {"y": SharedTensor("o", 0, 4)}


def test_null_parameters_mean_none() -> None:
    assert decode_request(body(parameters=None), "m", None).parameters == {}


def test_arrays_decoded_elsewhere_take_the_place_of_data() -> None:
    array = np.arange(4, dtype=np.float32).reshape(2, 2)
    payload = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2]}]}
    assert decode_request(payload, "m", None, arrays={"x": array}).inputs["x"] is array


# -- encoding ---------------------------------------------------------------------------------


def encode_response(response: InferResponse) -> bytes:
    """The HTTP front-end's encoder with every output as JSON."""
    return binary.encode_response(response, (), json_data)[0]


def test_response_json_layout() -> None:
    response = InferResponse(
        "m",
        "2",
        {"y": np.array([[1.5, 2]], np.float32), "s": np.array([b"a", "é".encode()], object)},
        {"y": "FP32", "s": "BYTES"},
        id="abc",
    )
    assert orjson.loads(encode_response(response)) == {
        "model_name": "m",
        "model_version": "2",
        "id": "abc",
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.0]},
            {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["a", "é"]},
        ],
    }


def test_response_without_id_has_no_id() -> None:
    response = InferResponse("m", "1", {"y": np.zeros(1, np.int8)}, {"y": "INT8"})
    assert "id" not in orjson.loads(encode_response(response))


def test_non_contiguous_and_fp16_outputs_encode() -> None:
    array = np.arange(12, dtype=np.float16).reshape(3, 4).T
    (out,) = orjson.loads(encode_response(InferResponse("m", "1", {"y": array}, {"y": "FP16"})))[
        "outputs"
    ]
    assert out["shape"] == [4, 3]
    assert orjson.loads(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY))["data"] == (
        array.ravel().astype(float).tolist()
    )


def _numeric_arrays() -> st.SearchStrategy[tuple[str, np.ndarray]]:
    def arrays(datatype: str) -> st.SearchStrategy[tuple[str, np.ndarray]]:
        dtype = np.dtype(NUMPY_TYPES[datatype])
        elements = None
        if dtype.kind == "f":
            width = {2: 16, 4: 32, 8: 64}[dtype.itemsize]
            elements = st.floats(allow_nan=False, allow_infinity=False, width=width)  # type: ignore[arg-type]
        shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
        return hnp.arrays(dtype, shapes, elements=elements).map(lambda a: (datatype, a))

    return st.sampled_from(NUMERIC_DATATYPES).flatmap(arrays)


@given(_numeric_arrays())
def test_round_trip_numeric(item: tuple[str, np.ndarray]) -> None:
    datatype, array = item
    response = InferResponse("m", "1", {"y": array}, {"y": datatype})
    output = orjson.loads(encode_response(response))["outputs"][0]
    assert output["datatype"] == datatype
    decoded = decode_data("y", datatype, output["shape"], output["data"])
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)
    assert np.signbit(decoded).tolist() == np.signbit(array).tolist()


@given(st.lists(st.text(max_size=10), max_size=8))
def test_round_trip_bytes(words: list[str]) -> None:
    array = np.empty(len(words), dtype=object)
    array[:] = [w.encode("utf-8", "surrogatepass") for w in words]
    if any("\ud800" <= c <= "\udfff" for w in words for c in w):
        return  # not UTF-8 text; JSON cannot carry it (the binary extension can)
    response = InferResponse("m", "1", {"y": array}, {"y": "BYTES"})
    output = orjson.loads(encode_response(response))["outputs"][0]
    assert decode_data("y", "BYTES", output["shape"], output["data"]).tolist() == array.tolist()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_finite_outputs_are_written_as_triton_writes_them(dtype: type) -> None:
    """orjson writes NaN and the infinities as null: an answer lost them (and their signs)."""
    import json

    array = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=dtype)
    body = orjson.dumps({"data": json_data(array, "FP32")}, option=orjson.OPT_SERIALIZE_NUMPY)
    assert body == b'{"data":[NaN, Infinity, -Infinity, 1.5]}'
    read = np.array(json.loads(body)["data"])
    np.testing.assert_array_equal(read, array.astype(np.float64))


@pytest.mark.parametrize("size", [3, codec.SUMMED_FINITE + 5])  # summed, then numpy's check
@pytest.mark.parametrize("odd", [np.nan, np.inf, -np.inf, None])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_lone_non_finite_output_value_is_seen_whatever_the_size(
    dtype: type, odd: float | None, size: int
) -> None:
    import json

    array = np.linspace(-2.0, 2.0, size).astype(dtype)
    if odd is not None:
        array[size // 2] = odd
    body = orjson.dumps({"data": json_data(array, "FP32")}, option=orjson.OPT_SERIALIZE_NUMPY)
    read = np.array(json.loads(body)["data"], dtype=np.float64)
    np.testing.assert_array_equal(read.astype(dtype), array)  # FP16 is written as FP32
    assert b"null" not in body


def test_finite_float64_outputs_whose_sum_overflows_are_written_whole() -> None:
    import json

    array = np.array([1.7e308, 1.7e308, -1.5], dtype=np.float64)  # summed: inf
    body = orjson.dumps({"data": json_data(array, "FP64")}, option=orjson.OPT_SERIALIZE_NUMPY)
    np.testing.assert_array_equal(np.array(json.loads(body)["data"]), array)


# -- simple_request: the common shape's own decoder --------------------------------------------


def _refuse_y(shapes: Any, types: Any) -> None:
    """A model's check: it takes any input but 'y'."""
    if "y" in shapes:
        raise InvalidInput("unexpected input 'y'")


def _general(payload: dict[str, Any]) -> InferRequest | str:
    """What the general path makes of `payload`: its request, or its error's message."""
    try:
        headers = codec.check_header(payload, _refuse_y)
        return decode_request(payload, "m", "1", None, headers)
    except InvalidInput as exc:
        return exc.message


def _simple(payload: dict[str, Any]) -> InferRequest | str | None:
    try:
        return simple_request(payload, "m", "1", _refuse_y)
    except InvalidInput as exc:
        return exc.message


def _same(simple: InferRequest, general: InferRequest) -> None:
    assert simple.inputs.keys() == general.inputs.keys()
    for name, array in general.inputs.items():
        assert simple.inputs[name].dtype == array.dtype
        assert simple.inputs[name].shape == array.shape
        np.testing.assert_array_equal(simple.inputs[name], array)
    rest = ("model_name", "model_version", "datatypes", "id", "outputs", "parameters")
    assert [getattr(simple, f) for f in rest] == [getattr(general, f) for f in rest]
    assert (simple.priority, simple.timeout_s) == (general.priority, general.timeout_s)


@pytest.mark.parametrize("datatype", [d for d in NUMERIC_DATATYPES if d != "BOOL"])
def test_the_common_shape_is_decoded_as_the_general_path_decodes_it(datatype: str) -> None:
    data = to_json(sample(datatype, [2, 3]), datatype)
    payload = {"id": "r1", "inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3],
                                      "data": data}]}  # fmt: skip
    simple = _simple(payload)
    assert isinstance(simple, InferRequest)
    general = _general(payload)
    assert isinstance(general, InferRequest)
    _same(simple, general)


def test_the_models_check_refuses_the_common_shape_as_the_general_path() -> None:
    payload = {"inputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    assert _simple(payload) == _general(payload) == "unexpected input 'y'"


@pytest.mark.parametrize(
    "payload",
    [
        body(parameters={"timeout": 5}),
        body(outputs=[{"name": "y"}]),
        body(id=7),
        {"inputs": []},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, True]}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1e39]}]},
        {"inputs": [{"name": "x", "datatype": "FP16", "shape": [1], "data": [65536]}]},
        {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [128]}]},
        {"inputs": [{"name": "x", "datatype": "INT16", "shape": [1], "data": [-32769]}]},
        {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [-1]}]},
        {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]}]},
        {
            "inputs": [
                {"name": "x", "datatype": "UINT64", "shape": [1], "data": [1.8446744073709552e19]}
            ]
        },
        {"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1], "data": [True]}]},
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0], "data": []}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0]}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [True], "data": [1.0]}]},
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0], "parameters": {}}
            ]
        },
        {"inputs": [tensor()["inputs"][0], tensor()["inputs"][0]]},
    ],
)
def test_anything_else_is_left_to_the_general_path(payload: dict[str, Any]) -> None:
    assert simple_request(payload, "m", None, _refuse_y) is None


_ODD_VALUES = st.sampled_from(
    [True, None, "1", [1], 1.5, -1, 256, 65536, 1e39, 2**63, 2**64 - 1, 1.8446744073709552e19]
)


def _values(datatype: str) -> st.SearchStrategy[Any]:
    """Values a client could send for `datatype` that fit it."""
    dtype = np.dtype(NUMPY_TYPES[datatype])
    if dtype.kind == "f":
        big = float(np.finfo(dtype).max)
        whole = int(min(big, 2**63))
        within = st.floats(-big, big) | st.integers(-whole, whole)
        return within | st.integers(2**24 - 2, 2**24 + 2) | st.integers(2**53 - 2, 2**53 + 2)
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max))


@st.composite
def _payloads(draw: st.DrawFn) -> dict[str, Any]:
    """Request bodies in the common shape, some with one thing a step outside it."""
    inputs = []
    for name in draw(
        st.lists(st.sampled_from(["x", "z", "y"]), min_size=1, max_size=2, unique=True)
    ):
        datatype = draw(st.sampled_from([d for d in NUMERIC_DATATYPES if d != "BOOL"]))
        shape = draw(st.lists(st.integers(1, 3), max_size=3))
        data = draw(
            st.lists(_values(datatype), min_size=math.prod(shape), max_size=math.prod(shape))
        )
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "data": data})
    payload: dict[str, Any] = {"inputs": inputs, **draw(st.sampled_from([{}, {"id": "r"}]))}
    item = draw(st.sampled_from(inputs))
    match draw(st.integers(0, 9)):  # 5 to 9: none
        case 0:
            item["data"][draw(st.integers(0, len(item["data"]) - 1))] = draw(_ODD_VALUES)
        case 1:
            item["datatype"] = draw(st.sampled_from(["BOOL", "BYTES", "FP8", 1]))
        case 2:
            item["shape"] = draw(
                st.sampled_from([[], [0], [-1], [True], [1.0], [len(item["data"]) + 1]])
            )
        case 3:
            item[draw(st.sampled_from(["parameters", "extra"]))] = {}
        case 4:
            payload[draw(st.sampled_from(["id", "outputs", "parameters"]))] = draw(_ODD_VALUES)
    return payload


@settings(max_examples=400)
@given(_payloads())
def test_the_common_shapes_decoder_agrees_with_the_general_path(payload: dict[str, Any]) -> None:
    simple = _simple(payload)
    if simple is None:
        return  # left to the general path
    general = _general(payload)
    if isinstance(simple, str) or isinstance(general, str):
        assert simple == general
    else:
        _same(simple, general)
