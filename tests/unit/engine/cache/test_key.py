from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.cache.key import (
    OFFLOAD_INPUT_BYTES,
    TRANSPORT_PARAMETERS,
    cache_key,
    cache_key_async,
    cache_requested,
    canonical,
    namespace,
    request_key,
)
from engine.datatypes import NUMPY_DTYPES
from engine.errors import InvalidInput

NUMERIC = [name for name in NUMPY_DTYPES if name != "BYTES"]
# Datatypes whose bytes can be reinterpreted as another datatype of the same item size.
SAME_SIZE = {
    name: [other for other in NUMERIC if other != name and
           NUMPY_DTYPES[other].itemsize == NUMPY_DTYPES[name].itemsize]
    for name in NUMERIC
}  # fmt: skip


@dataclass
class Req:
    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    outputs: list[str] | None
    parameters: dict[str, Any] = field(default_factory=dict)
    model: str = "m"
    version: str = "1"
    fingerprint: int | str = 0

    def key(self) -> bytes:
        return request_key(
            self.model,
            self.version,
            self.fingerprint,
            self.inputs,
            self.datatypes,
            self.outputs,
            self.parameters,
        )


@st.composite
def tensors(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from(list(NUMPY_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if datatype == "BYTES":
        size = int(np.prod(shape))
        items = draw(st.lists(st.binary(max_size=6), min_size=size, max_size=size))
        array = np.empty(size, dtype=object)
        array[:] = items
        return datatype, array.reshape(shape)
    return datatype, draw(hnp.arrays(NUMPY_DTYPES[datatype], shape))


param_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)


@st.composite
def requests(draw: st.DrawFn) -> Req:
    names = draw(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3, unique=True))
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for name in names:
        datatypes[name], inputs[name] = draw(tensors())
    outputs = draw(st.none() | st.lists(st.sampled_from(["a", "b", "c"]), unique=True))
    keys = st.text(max_size=6).filter(lambda k: k not in TRANSPORT_PARAMETERS)
    parameters = draw(st.dictionaries(keys, param_values, max_size=3))
    return Req(inputs, datatypes, outputs, parameters)


def _flip_byte(array: np.ndarray, datatype: str, index: int) -> np.ndarray | None:
    if array.size == 0:
        return None
    if datatype == "BYTES":
        flat = array.ravel().copy()
        i = index % flat.size
        flat[i] = flat[i] + b"\x00" if not flat[i] else bytes([flat[i][0] ^ 1]) + flat[i][1:]
        return flat.reshape(array.shape)
    raw = bytearray(array.tobytes())
    raw[index % len(raw)] ^= 1
    return np.frombuffer(bytes(raw), dtype=array.dtype).reshape(array.shape)


def _mutations(req: Req, index: int) -> list[tuple[str, Req]]:
    name = sorted(req.inputs)[index % len(req.inputs)]
    array, datatype = req.inputs[name], req.datatypes[name]
    out: list[tuple[str, Req]] = []

    def with_input(new: np.ndarray, new_type: str | None = None) -> Req:
        types = {**req.datatypes, name: new_type or datatype}
        return replace(req, inputs={**req.inputs, name: new}, datatypes=types)

    flipped = _flip_byte(array, datatype, index)
    if flipped is not None:
        out.append(("input byte", with_input(flipped)))
    out.append(("shape", with_input(array.reshape((*array.shape, 1)))))
    for other in SAME_SIZE.get(datatype, []):
        out.append(("dtype " + other, with_input(array.view(NUMPY_DTYPES[other]), other)))
    out.append(("datatype only", with_input(array, "FP64" if datatype != "FP64" else "FP32")))
    renamed = {k: v for k, v in req.inputs.items() if k != name} | {name + "_": array}
    renamed_types = {**req.datatypes, name + "_": datatype}
    out.append(("input name", replace(req, inputs=renamed, datatypes=renamed_types)))
    outputs = None if req.outputs is not None else []
    out.append(("outputs None vs list", replace(req, outputs=outputs)))
    out.append(("outputs extra", replace(req, outputs=[*(req.outputs or []), "zz"])))
    out.append(("new parameter", replace(req, parameters={**req.parameters, "temperature": 0.5})))
    for param, value in req.parameters.items():
        changed = {"v": value} if value != {"v": value} else None
        out.append(
            (f"parameter {param}", replace(req, parameters={**req.parameters, param: changed}))
        )
    out.append(("model", replace(req, model=req.model + "x")))
    out.append(("version", replace(req, version="2")))
    out.append(("fingerprint", replace(req, fingerprint=1)))
    return out


@settings(max_examples=150, deadline=None)
@given(requests(), st.integers(min_value=0, max_value=1000))
def test_any_result_changing_difference_changes_the_key(req: Req, index: int) -> None:
    base = req.key()
    assert len(base) == 32
    for what, mutated in _mutations(req, index):
        assert mutated.key() != base, f"changing the {what} kept the key"


@settings(max_examples=100, deadline=None)
@given(requests(), st.dictionaries(st.sampled_from(sorted(TRANSPORT_PARAMETERS)), param_values))
def test_transport_parameters_and_ordering_do_not_change_the_key(
    req: Req, transport: dict[str, Any]
) -> None:
    shuffled = replace(
        req,
        inputs=dict(reversed(req.inputs.items())),
        datatypes=dict(reversed(req.datatypes.items())),
        outputs=None if req.outputs is None else list(reversed(req.outputs)),
        parameters={**dict(reversed(req.parameters.items())), **transport},
    )
    assert shuffled.key() == req.key()


def test_non_contiguous_and_big_endian_inputs_hash_like_their_canonical_form() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    columns = np.asfortranarray(base)
    swapped = base.astype(">f4")
    keys = {
        request_key("m", "1", 0, {"x": a}, {"x": "FP32"}, None, {})
        for a in (base, columns, swapped)
    }
    assert len(keys) == 1


def test_str_and_bytes_elements_of_bytes_tensors_hash_alike() -> None:
    as_bytes = np.array([b"ab", b"c"], dtype=object)
    as_str = np.array(["ab", "c"], dtype=object)
    shifted = np.array([b"a", b"bc"], dtype=object)  # same concatenation, other split
    key = [request_key("m", "1", 0, {"s": a}, {"s": "BYTES"}, None, {}) for a in
           (as_bytes, as_str, shifted)]  # fmt: skip
    assert key[0] == key[1]
    assert key[0] != key[2]


def test_canonical_tells_json_lookalikes_apart() -> None:
    values = [True, 1, 1.0, "1", None, [1], {"1": 1}, 0, False, "", [], {}]
    assert len({canonical(v) for v in values}) == len(values)
    assert canonical({"a": 1, "b": 2}) == canonical({"b": 2, "a": 1})


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_canonical_of_deep_nesting_is_iterative_and_exact() -> None:
    deep = canonical(nested(5000))  # far past Python's recursion limit
    assert deep.startswith(b"l" if 5000 % 2 == 0 else b"d")
    assert deep != canonical(nested(5001)) != canonical(nested(5000, 2))
    assert canonical(nested(5000)) == deep
    # The iterative encoder writes the same bytes as the framed recursive definition.
    assert canonical([{"b": [1, "x"], "a": None}, 2.5]) == (
        b"l" + (2).to_bytes(8, "little")
        + b"d" + (2).to_bytes(8, "little")
        + (1).to_bytes(8, "little") + b"a" + b"N"
        + (1).to_bytes(8, "little") + b"b"
        + b"l" + (2).to_bytes(8, "little") + b"i" + (1).to_bytes(8, "little") + b"1"
        + b"s" + (1).to_bytes(8, "little") + b"x"
        + b"f" + (len((2.5).hex())).to_bytes(8, "little") + (2.5).hex().encode()
    )  # fmt: skip


def test_request_key_of_deeply_nested_parameters() -> None:
    args = ({"x": np.zeros(2, np.int64)}, {"x": "INT64"}, None)
    assert request_key("m", "1", 0, *args, {"p": nested(3000)}) != request_key(
        "m", "1", 0, *args, {"p": nested(3001)}
    )


def test_namespace_separates_versions_and_fingerprints_and_escapes_colons() -> None:
    assert namespace("sluice", "resnet", "1", 7) == b"sluice:resnet:1:7:"
    assert namespace("sluice", "a:b", "1", 0) != namespace("sluice", "a", "b:1", 0)
    assert namespace("sluice", "m", "1", 0) != namespace("sluice", "m", "2", 0)
    assert namespace("sluice", "m", "1", 0) != namespace("sluice", "m", "1", 1)


def test_cache_key_is_namespace_plus_hex_digest() -> None:
    args = ({"x": np.zeros(2, np.int64)}, {"x": "INT64"}, None, {})
    key = cache_key("p", "m", "3", "abc", *args)
    assert key == b"p:m:3:abc:" + request_key("m", "3", "abc", *args).hex().encode()


@pytest.mark.parametrize(("parameters", "expected"), [({}, True), ({"cache": True}, True),
                                                      ({"cache": False}, False)])  # fmt: skip
def test_cache_requested(parameters: dict[str, Any], expected: bool) -> None:
    assert cache_requested(parameters) is expected


def test_cache_parameter_must_be_boolean() -> None:
    with pytest.raises(InvalidInput, match=r"parameter 'cache' must be a boolean.*'no'"):
        cache_requested({"cache": "no"})


async def test_cache_key_async_matches_cache_key_for_small_and_large_inputs() -> None:
    for size in (4, OFFLOAD_INPUT_BYTES // 4 + 1):  # below and above the off-loop threshold
        inputs = {"x": np.arange(size, dtype=np.float32)}
        args = ("p", "m", "1", 0, inputs, {"x": "FP32"}, ["y"], {"k": 1})
        assert await cache_key_async(*args) == cache_key(*args)
