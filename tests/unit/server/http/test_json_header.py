"""json_header.loads: the same document as orjson.loads, with large bodies' input data deferred;
and RawData.numbers, which reads deferred data straight to numbers."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidInput
from server.http import json_header
from server.http.json_header import LAZY_BYTES, RawData, loads

PAD = " " * LAZY_BYTES  # whitespace makes any body large enough to be read lazily


def resolved(value: Any) -> Any:
    """`value` with every RawData parsed."""
    if isinstance(value, RawData):
        return value.parse()
    if isinstance(value, dict):
        return {k: resolved(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolved(v) for v in value]
    return value


def body_of(document: Any, spaced: bool) -> bytes:
    raw = orjson.dumps(document, option=orjson.OPT_INDENT_2 if spaced else 0)
    return raw[:1] + PAD.encode() + raw[1:] if raw.startswith(b"{") else raw


def test_data_of_a_large_body_is_deferred() -> None:
    data = [[1.5, 2], [3, 4]]
    document = {"inputs": [{"name": "x", "data": data, "shape": [2, 2]},
                           {"data": ["a\"b]", "c:"], "name": "s"}], "id": "r"}  # fmt: skip
    parsed = loads(body_of(document, spaced=True))
    assert all(isinstance(item["data"], RawData) for item in parsed["inputs"])
    assert resolved(parsed) == document


@pytest.mark.parametrize(
    "first",
    [
        {"name": "b", "parameters": {"binary_data_size": 8}},  # no data: the indexes shift
        {"name": "p", "parameters": {"data": [9]}, "data": [1]},  # "data" elsewhere first
    ],
)
def test_data_is_deferred_in_any_layout(first: dict[str, Any]) -> None:
    """The common layout (one `data` key an input, in order) is cut by finding each `"data":`;
    any other by the walk over the header's structure."""
    document = {"inputs": [first, {"name": "x", "data": [[1.5, 2], [3, 4]]}]}
    parsed = loads(body_of(document, spaced=False))
    assert isinstance(parsed["inputs"][1]["data"], RawData)
    assert resolved(parsed) == document


def test_string_data_longer_than_a_scan_chunk() -> None:
    words = ["a" * 999 + '"', "{x}: [y]", "b" * 3_000_000, *(["c:d"] * 200_000)]
    document = {"inputs": [{"name": "s", "data": words, "shape": [len(words)]},
                           {"data": [1, 2], "name": "n"}]}  # fmt: skip
    raw = orjson.dumps(document)
    parsed = loads(raw)
    assert isinstance(parsed["inputs"][0]["data"], RawData)
    assert resolved(parsed) == document


def test_bad_data_is_reported_where_it_is_in_the_body() -> None:
    raw = b'{"inputs": [{"name": "x",\n "data": [1, 2, oops]}], "pad": "' + PAD.encode() + b'"}'
    parsed = loads(raw)
    with pytest.raises(InvalidInput) as caught:
        parsed["inputs"][0]["data"].parse()
    pos, newline = raw.index(b"oops"), raw.index(b"\n")
    assert caught.value.message.startswith("request body is not valid JSON: ")
    assert caught.value.message.endswith(f": line 2 column {pos - newline} (char {pos})")


def test_small_bodies_are_parsed_whole() -> None:
    document = {"inputs": [{"name": "x", "data": [1, 2]}]}
    assert loads(orjson.dumps(document)) == document


@pytest.mark.parametrize(
    "raw",
    [
        b'{"inputs": [{"data": [1, 2,]}]}',
        b'{"inputs": [{"data": [1, 2]}]} trailing',
        b'{"inputs": [{"data": [1, 2}]}',
        b'{"inputs": [{"data": "\xff"}]}',
    ],
)
def test_malformed_bodies_fail_like_orjson_or_when_their_data_is_read(raw: bytes) -> None:
    raw = raw[:1] + PAD.encode() + raw[1:]
    with pytest.raises((orjson.JSONDecodeError, InvalidInput)):
        resolved(loads(raw))
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab"\\:{}[], \n\u00e9'), max_size=6)
)
values = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.sampled_from(["data", "name", "inputs", "a:b", 'q"']), c, max_size=3)
    ),
    max_leaves=12,
)
inputs = st.lists(st.dictionaries(st.sampled_from(["name", "data", "shape", "parameters"]), values,
                                  max_size=4) | values, max_size=4)  # fmt: skip
documents = st.fixed_dictionaries(
    {"inputs": inputs}, optional={"parameters": values, "outputs": values, "id": scalars}
)


@settings(max_examples=300, deadline=None)
@given(documents, st.booleans())
def test_the_same_document_as_orjson(document: dict[str, Any], spaced: bool) -> None:
    raw = body_of(document, spaced)
    assert resolved(loads(raw)) == orjson.loads(raw)


def test_a_body_of_many_data_values_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each data value's end was looked for by scanning on from it for `{`, `}` and `:`, to the
    body's end when none came: a body of thousands of small data values before a long string
    made every one of them scan the string again (a 256 kB body, decoded on the event loop,
    took 65 ms; 8 MB, 3.6 s). Each byte is now looked for past a position once."""
    scanned = 0

    def find(text: bytes, char: bytes, start: int) -> int:
        nonlocal scanned
        at = real(text, char, start)
        scanned += at - start
        return at

    real = json_header._find
    monkeypatch.setattr(json_header, "_find", find)
    body = b'{"inputs":[{' + b'"data":1,' * 2000 + b'"pad":"' + b"x" * 200_000 + b'"}]}'
    parsed = loads(body)
    assert parsed["inputs"][0]["pad"] == "x" * 200_000
    assert scanned <= 8 * len(body), scanned / len(body)


@pytest.mark.parametrize("unit", [b'{"data":1},', b'{"name":"x","data":[1]},'])
def test_a_body_of_more_data_values_than_any_model_has_inputs_is_parsed_whole(
    monkeypatch: pytest.MonkeyPatch, unit: bytes
) -> None:
    """Each data value cut from the body costs Python steps where orjson reads a small value in
    nanoseconds: 256 kB of `{"data":1},` took 110 ms on the event loop (0.6 ms parsed whole),
    16 MB 6.5 s and 90x its size in memory. Past _MAX_CUTS values the body is parsed whole."""
    spans = 0

    def value_span(*args: Any) -> tuple[int, int]:
        nonlocal spans
        spans += 1
        return real(*args)

    real = json_header._value_span
    monkeypatch.setattr(json_header, "_value_span", value_span)
    body = b'{"inputs":[' + unit * 20_000 + b'{"data":2}]}'
    parsed = loads(body)
    assert spans <= 4096, spans  # two scans of at most _MAX_CUTS + 1 values each
    assert parsed == orjson.loads(body)


@pytest.mark.parametrize(
    "text",
    [b"[[1, 2], [3]]", b"[[1, 2], [[3], 4]]", b"[[1, 2], [3, [4]]]", b"[[1], 2]", b"[1, [2]]",
     b"[[], [1]]", b"[" * 65 + b"1" + b"]" * 65, b'[1, "[2"]', b"[1, true]", b"[1, null]",
     b"[1e400]", b"[18446744073709551616]", b"[1,]", b"[01]", b"[NaN]", b"5", b"[1] 2"],
)  # fmt: skip
def test_only_numbers_in_regularly_nested_lists_are_read_to_numbers(text: bytes) -> None:
    # simdjson flattens any nesting, ragged too: the lists are checked a level at a time, and
    # everything else is left to the walk, which names the problem.
    assert RawData(text, 0, len(text)).numbers("d") is None
    for good, values in ((b"[1, 2.5]", [1, 2.5]), (b"[[1, 2], [3, 4]]", [1, 2, 3, 4]),
                         (b"[[[1]], [[2]]]", [1, 2]), (b"[[]]", [])):  # fmt: skip
        read = RawData(good, 0, len(good)).numbers("d")  # the parser is fine after a refusal
        assert read is not None
        assert np.frombuffer(read, np.float64).tolist() == values


def test_a_kept_parser_is_not_replaced_by_a_large_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread keeps one parser for small data; data past PARSER_KEEPS_BYTES gets its own, so
    # no thread holds the buffers of the largest body it ever read.
    small, large = b"[1, 2]", b"[" + b"1, " * 40 + b"2]"
    monkeypatch.setattr(json_header, "PARSER_KEEPS_BYTES", 64)
    assert np.frombuffer(RawData(small, 0, len(small)).numbers("i"), "i8").sum() == 3
    kept = json_header._PARSERS.parser
    assert np.frombuffer(RawData(large, 0, len(large)).numbers("i"), "i8").sum() == 42
    assert json_header._PARSERS.parser is kept
