"""The binary tensor data extension, checked against tritonclient's own HTTP encoder and parser
(tritonclient.http has no protobuf classes, so it imports next to sluice's)."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.http import InferInput, InferRequestedOutput
from tritonclient.http._infer_result import InferResult
from tritonclient.http._utils import _get_inference_request

from engine.errors import InvalidInput, PayloadTooLarge
from engine.types import InferResponse
from server.http import binary

FIXED = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from([*FIXED, "BYTES"]))
    shape = draw(SHAPES)
    if datatype == "BYTES":
        count = int(np.prod(shape))
        # UTF-8 text: tritonclient refuses non-UTF-8 BYTES for JSON tensors.
        items = draw(st.lists(st.text(max_size=8).map(str.encode), min_size=count, max_size=count))
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return datatype, array.reshape(shape)
    elements = None
    if datatype.startswith("FP"):
        elements = st.floats(
            allow_nan=False, allow_infinity=False, width=np.dtype(FIXED[datatype]).itemsize * 8
        )
    return datatype, draw(hnp.arrays(FIXED[datatype], shape, elements=elements))


def json_data(array: np.ndarray, datatype: str) -> Any:
    if datatype == "BYTES":
        return [item.decode() for item in array.reshape(-1)]
    return array.reshape(-1)


def client_request(
    tensors_: list[tuple[str, np.ndarray]], as_binary: list[bool]
) -> tuple[bytes, dict[str, str]]:
    """A request body exactly as tritonclient.http builds it."""
    inputs = []
    for index, ((datatype, array), use_binary) in enumerate(zip(tensors_, as_binary, strict=True)):
        tensor = InferInput(f"in{index}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=use_binary)
        inputs.append(tensor)
    body, json_size = _get_inference_request(inputs, "", None, 0, False, False, 0, None, None)
    headers = {} if json_size is None else {binary.HEADER_LENGTH: str(json_size)}
    return body, headers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(tensors(), st.booleans()), min_size=1, max_size=4))
def test_client_request_round_trip(items: list[tuple[tuple[str, np.ndarray], bool]]) -> None:
    body, headers = client_request([t for t, _ in items], [b for _, b in items])
    split = binary.split_request(body, headers)
    for index, ((_, array), use_binary) in enumerate(items):
        name = f"in{index}"
        entry = split.header["inputs"][index]
        assert entry["name"] == name
        if use_binary:
            decoded = split.arrays[name]
            assert decoded.shape == array.shape
            assert decoded.dtype == array.dtype
            np.testing.assert_array_equal(decoded, array)
            assert "data" not in entry
        else:
            assert name not in split.arrays
            assert "data" in entry


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(tensors(), st.booleans()), min_size=1, max_size=4), st.booleans())
def test_response_parsed_by_tritonclient(
    items: list[tuple[tuple[str, np.ndarray], bool]], with_id: bool
) -> None:
    outputs = {f"out{i}": array for i, ((_, array), _) in enumerate(items)}
    datatypes = {f"out{i}": datatype for i, ((datatype, _), _) in enumerate(items)}
    chosen = {f"out{i}" for i, (_, use_binary) in enumerate(items) if use_binary}
    response = InferResponse("m", "3", outputs, datatypes, id="req-7" if with_id else None)
    body, headers = binary.encode_response(response, chosen, json_data)
    result = InferResult.from_response_body(body, header_length=headers.get(binary.HEADER_LENGTH))
    document = result.get_response()
    assert document["model_name"] == "m"
    assert document["model_version"] == "3"
    assert document.get("id") == ("req-7" if with_id else None)
    assert [o["name"] for o in document["outputs"]] == list(outputs)
    for name, array in outputs.items():
        got = result.as_numpy(name)
        assert got.shape == array.shape
        if datatypes[name] == "BYTES" and name not in chosen:
            assert list(got.reshape(-1)) == [x.decode() for x in array.reshape(-1)]
        else:
            np.testing.assert_array_equal(got, array)
    if chosen:
        assert headers["Content-Type"] == "application/octet-stream"
    else:
        assert binary.HEADER_LENGTH not in headers
        assert orjson.loads(body) == document


def test_fixed_size_decode_is_zero_copy() -> None:
    array = np.arange(1000, dtype=np.float32).reshape(10, 100)
    body, headers = client_request([("FP32", array)], [True])
    decoded = binary.split_request(body, headers).arrays["in0"]
    assert np.shares_memory(decoded, np.frombuffer(body, np.uint8))
    assert not decoded.flags.writeable
    np.testing.assert_array_equal(decoded, array)


def test_nan_and_infinity_survive_binary() -> None:
    array = np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float64)
    body, headers = client_request([("FP64", array)], [True])
    decoded = binary.split_request(body, headers).arrays["in0"]
    np.testing.assert_array_equal(decoded, array)
    assert np.signbit(decoded[3])


def test_plain_json_body_has_no_arrays() -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]})
    split = binary.split_request(body, {"content-type": "application/json"})
    assert split.arrays == {}
    assert split.header["inputs"][0]["data"] == [1]


def _body(header: dict[str, Any], data: bytes) -> tuple[bytes, dict[str, str]]:
    json_bytes = orjson.dumps(header)
    return json_bytes + data, {"inference-header-content-length": str(len(json_bytes))}


def _one(datatype: str, shape: list[int], size: int, **extra: Any) -> dict[str, Any]:
    params = {"binary_data_size": size}
    return {
        "inputs": [
            {"name": "x", "datatype": datatype, "shape": shape, "parameters": params, **extra}
        ]
    }


@pytest.mark.parametrize(
    ("body_headers", "message"),
    [
        ((b"{}", {binary.HEADER_LENGTH: "abc"}), "Inference-Header-Content-Length is 'abc'"),
        ((b"{}", {binary.HEADER_LENGTH: "9"}), "is 9 but the body has 2 bytes"),
        ((b"{}", {binary.HEADER_LENGTH: "9" * 4301}), f"is {'9' * 40}... but the body has 2 "),
        ((b"{]", {binary.HEADER_LENGTH: "2"}), "inference header is not valid JSON"),
        ((b"[1]", {binary.HEADER_LENGTH: "3"}), "must be a JSON object; got list"),
        (
            _body(_one("FP32", [2, 3], 20), bytes(20)),
            "[2, 3] of FP32, which is 24 bytes; received 20",
        ),
        (_body(_one("FP32", [1], 8), bytes(4)), "declares 8 bytes of binary data at offset 0"),
        (_body(_one("FP32", [1], 4), bytes(6)), "holds 6 bytes after the inference header"),
        (_body(_one("FP99", [1], 4), bytes(4)), "input 'x': unknown datatype 'FP99'"),
        (_body(_one("FP32", [-1], 4), bytes(4)), "non-negative integers, got [-1]"),
        (_body(_one("FP32", [1], -4), b""), "binary_data_size -4; expected an integer >= 0"),
        (_body(_one("FP32", [1], 4, data=[1.0]), bytes(4)), "both 'data' and binary_data_size"),
        (_body(_one("BOOL", [2], 2), b"\x01\x02"), "BOOL but holds bytes other than 0 and 1"),
        (_body(_one("BYTES", [2], 6), b"\x01\x00\x00\x00a\x00"), "ends at byte 6 before element 1"),
        (_body(_one("BYTES", [1], 6), b"\x05\x00\x00\x00ab"), "element 0 declares 5 bytes; only 2"),
        (_body(_one("BYTES", [1], 6), b"\x01\x00\x00\x00ab"), "1 bytes left over after the 1"),
        (
            (orjson.dumps(_one("FP32", [1], 4)), {}),
            "binary_data_size but the request has no Inference-Header-Content-Length",
        ),
    ],
)
def test_malformed_bodies_are_invalid_input(
    body_headers: tuple[bytes, dict[str, str]], message: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        binary.split_request(*body_headers)
    assert message in info.value.message


@pytest.mark.parametrize("length", [True, False])  # the binary extension's header, or plain JSON
@pytest.mark.parametrize(
    ("size", "shown"), [(2**64, "2^64 or more"), (2**70, "2^64 or more"), (-(2**64), "below -2^63")]
)
def test_binary_data_size_past_64_bits_is_out_of_range(length: bool, size: int, shown: str) -> None:
    # json, not orjson: orjson cannot write an integer past 64 bits (nor can tritonclient's).
    header = json.dumps(_one("FP32", [1], size)).encode()
    headers = {binary.HEADER_LENGTH: str(len(header))} if length else {}
    with pytest.raises(InvalidInput) as info:
        binary.split_request(header + (bytes(4) if length else b""), headers)
    # The parser reads it as a double, whose digits (1.1805916207174113e+21) misstate it.
    assert info.value.message == (
        f"input 'x': binary_data_size is out of range (0 to {2**64 - 1}), got {shown}"
    )


def test_a_shape_dimension_past_64_bits_is_out_of_range() -> None:
    header = json.dumps(_one("FP32", [0, 2**70], 0)).encode()
    with pytest.raises(InvalidInput) as info:
        binary.split_request(header, {binary.HEADER_LENGTH: str(len(header))})
    # Not "shape must be a list of non-negative integers, got [0, 1.1805916207174113e+21]".
    assert info.value.message == (
        f"input 'x': shape[1] is out of range (0 to {2**60 - 1}), got 2^64 or more"
    )


def _flags(header: dict[str, Any]) -> binary.BinaryRequest:
    return binary.split_request(orjson.dumps({"inputs": [], **header}), {})


def test_binary_outputs_follow_request_and_output_parameters() -> None:
    names = ["a", "b", "c"]
    assert _flags({}).binary_outputs(names) == frozenset()
    everything = _flags({"parameters": {"binary_data_output": True}})
    assert everything.binary_outputs(names) == set(names)
    header = {
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
    }
    assert _flags(header).binary_outputs(names) == {"a"}
    requested = [InferRequestedOutput("c", binary_data=True)._get_tensor(), {"name": "a"}]
    assert _flags({"outputs": requested}).binary_outputs(names) == {"c"}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"parameters": {"binary_data_output": "yes"}}, "binary_data_output is 'yes'"),
        ({"outputs": [{"name": "a", "parameters": {"binary_data": 1}}]}, "binary_data 1; expected"),
        ({"outputs": [{"name": "a", "parameters": {"classification": 2}}]}, "classification"),
        ({"outputs": [{"name": "a", "parameters": 5}]}, "output 'a' has parameters 5"),
        ({"outputs": {"name": "a"}}, "'outputs' must be a list; got dict"),
    ],
)
def test_bad_output_parameters_fail_at_split(header: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        _flags(header)
    assert message in info.value.message


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
def test_compressed_request_and_response(encoding: str, compress: Any) -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    body, headers = client_request([("INT64", array)], [True])
    plain = binary.decompress(compress(body), encoding, limit_bytes=1 << 20)
    np.testing.assert_array_equal(binary.split_request(plain, headers).arrays["in0"], array)

    response = InferResponse("m", "1", {"y": array}, {"y": "INT64"})
    out, out_headers = binary.encode_response(response, {"y"}, json_data, accept_encoding=encoding)
    assert out_headers["Content-Encoding"] == encoding
    result = InferResult.from_response_body(
        out, header_length=out_headers[binary.HEADER_LENGTH], content_encoding=encoding
    )
    np.testing.assert_array_equal(result.as_numpy("y"), array)


def test_decompression_is_bounded_and_checked() -> None:
    with pytest.raises(PayloadTooLarge) as info:
        binary.decompress(gzip.compress(bytes(10_000)), "gzip", limit_bytes=1000)
    # Inflation stops at the limit, so the message names no size the body never reached.
    assert info.value.message == "request body exceeds the limit of 1000 bytes once inflated (gzip)"
    with pytest.raises(InvalidInput, match="unsupported Content-Encoding 'br'"):
        binary.decompress(b"x", "br", limit_bytes=10)
    with pytest.raises(InvalidInput, match="not valid gzip data"):
        binary.decompress(b"not gzip", "gzip", limit_bytes=10)
    with pytest.raises(InvalidInput, match="truncated deflate"):
        binary.decompress(zlib.compress(bytes(100))[:-3], "deflate", limit_bytes=1000)
    assert binary.decompress(b"abc", None, limit_bytes=1) == b"abc"


_DECOMPRESSOBJ = zlib.decompressobj


class _Inflater:
    """zlib's decompressobj, recording how much each call may return (and, in `given`, how many
    bytes of input each call is handed)."""

    def __init__(self, wbits: int, asked: list[int], given: list[int] | None = None) -> None:
        self._inner, self._asked, self._given = _DECOMPRESSOBJ(wbits=wbits), asked, given

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        self._asked.append(max_length)
        if self._given is not None:
            self._given.append(len(data))
        return self._inner.decompress(data, max_length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("plain_bytes", [3 * binary.INFLATE_STEP_BYTES + 5, 40 << 20])
def test_inflation_runs_in_bounded_steps(monkeypatch: pytest.MonkeyPatch, plain_bytes: int) -> None:
    """No single zlib call inflates more than a step: between steps the inflating thread gives
    up the GIL (one call up to the limit held it for the final copy, about a second for a
    200 MiB bomb), and a bomb is refused one step past the limit at most."""
    asked: list[int] = []
    monkeypatch.setattr(binary.zlib, "decompressobj", lambda wbits: _Inflater(wbits, asked))
    body = gzip.compress(b" " * plain_bytes)
    limit = 32 << 20
    if plain_bytes > limit:
        with pytest.raises(PayloadTooLarge):
            binary.decompress(body, "gzip", limit)
        assert sum(asked) == limit + 1  # stopped as soon as it passed the limit
    else:
        assert binary.decompress(body, "gzip", limit) == b" " * plain_bytes
    assert max(asked) == binary.INFLATE_STEP_BYTES


@pytest.mark.parametrize("budget", [None, 1000])
def test_inflation_hands_zlib_each_input_byte_about_once(
    monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """zlib copies the input a call leaves unread (unconsumed_tail); handed the whole rest of
    the body at every step, a body that inflates little (random data) was copied once per
    step: 80 MB of gzip took 1.3 s of CPU (40 MB 0.24 s), and the event loop's first step,
    inflating a budget, copied all of it (38 ms). The input now goes in a step at a time."""
    given: list[int] = []
    monkeypatch.setattr(binary, "INFLATE_STEP_BYTES", 1 << 16)
    monkeypatch.setattr(zlib, "decompressobj", lambda wbits: _Inflater(wbits, [], given))
    plain = random.Random(5).randbytes(2 << 20)
    body = gzip.compress(plain, compresslevel=1)
    if budget is None:
        assert binary.decompress(body, "gzip", 4 << 20) == plain
        assert sum(given) <= 2 * len(body), sum(given) / len(body)
    else:  # a step of input inflates past the budget: the rest of the body is not touched
        assert binary.decompress(body, "gzip", 4 << 20, budget) is None
        assert sum(given) <= 2 * binary.INFLATE_STEP_BYTES, sum(given) / len(body)


def test_no_compression_unless_asked() -> None:
    response = InferResponse("m", "1", {"y": np.zeros(3, np.float32)}, {"y": "FP32"})
    for accept in (None, "*", "br", "gzip;q=0", "gzip;q=0.000", "gzip; Q=0", "deflate;q=0.00"):
        _, headers = binary.encode_response(response, set(), json_data, accept_encoding=accept)
        assert "Content-Encoding" not in headers, accept


def test_a_header_length_of_many_digits_is_read_without_int_s_digit_limit() -> None:
    """int() refuses strings of over 4300 digits: it was a 500."""
    split = binary.split_request(b"{}", {binary.HEADER_LENGTH: "0" * 5000 + "2"})
    assert split.header == {}


@pytest.mark.parametrize("length", [" 2", "2 ", "+2", "1_0", "\u0662", "0x2", "-0", ""])
def test_header_length_takes_only_ascii_digits(length: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        binary.split_request(b"{}", {binary.HEADER_LENGTH: length})
    assert caught.value.message == (
        f"{binary.HEADER_LENGTH} is {length!r}; expected a whole number of bytes"
    )


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
def test_bytes_after_the_compressed_stream_are_invalid_input(encoding: str, compress: Any) -> None:
    body = compress(b'{"inputs": []}') + b"garbage"
    with pytest.raises(InvalidInput) as caught:
        binary.decompress(body, encoding, limit_bytes=1000)
    assert caught.value.message == f"body has 7 bytes after the end of its {encoding} data"


def test_decompression_within_a_budget_stops_early() -> None:
    bomb = gzip.compress(bytes(100_000))
    assert binary.decompress(bomb, "gzip", limit_bytes=200_000, budget_bytes=1000) is None
    assert binary.decompress(bomb, "gzip", 200_000, budget_bytes=100_000) == bytes(100_000)
    with pytest.raises(PayloadTooLarge):  # past the limit itself: no second try is needed
        binary.decompress(bomb, "gzip", limit_bytes=1000, budget_bytes=5000)
    assert binary.decompress(b"abc", None, limit_bytes=10, budget_bytes=1) == b"abc"


def test_the_header_is_checked_before_any_tensor_is_decoded() -> None:
    seen: list[dict[str, Any]] = []

    def refuse(header: dict[str, Any]) -> None:
        seen.append(header)
        raise InvalidInput("refused by the model")

    # 2_000_000 BYTES elements of one byte each would be 2 million objects; the data is also
    # short, so decoding first would fail with another message.
    tensor = {"name": "s", "datatype": "BYTES", "shape": [2_000_000],
              "parameters": {"binary_data_size": 10}}  # fmt: skip
    header = orjson.dumps({"inputs": [tensor]})
    body = header + bytes(10)
    with pytest.raises(InvalidInput, match="refused by the model"):
        binary.split_request(body, {binary.HEADER_LENGTH: str(len(header))}, refuse)
    assert seen == [{"inputs": [tensor]}]
