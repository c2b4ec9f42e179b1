from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.datatypes import NUMPY_DTYPES
from loadtests.payloads import (
    REPEATED_POOL_SIZE,
    PayloadFactory,
    TensorShape,
    binary_body,
    json_body,
    output_names,
    random_tensor,
    raw_bytes,
    resolve_inputs,
)

ROOT = Path(__file__).resolve().parents[3]

METADATA = {
    "name": "m",
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 16]},
        {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "fixed", "datatype": "BOOL", "shape": [3]},
    ],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}, {"name": "z"}],
}


def test_payloads_import_only_the_engines_datatypes() -> None:
    # Locust processes import this module: the engine must not bring the server along.
    code = (
        "import sys, loadtests.payloads; "
        "print(sorted(m for m in sys.modules if m.startswith(('engine', 'server'))))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert found.stdout.strip() == "['engine', 'engine.datatypes', 'engine.errors']"


def test_dynamic_dimensions_resolve() -> None:
    shapes = resolve_inputs(METADATA, batch_size=4, dynamic_size=9)
    assert shapes == [
        TensorShape("x", "FP32", (4, 16)),
        TensorShape("ids", "INT64", (4, 9)),
        TensorShape("fixed", "BOOL", (3,)),
    ]
    assert output_names(METADATA) == ["y", "z"]


def test_unknown_datatype_and_no_inputs() -> None:
    bad = {"inputs": [{"name": "x", "datatype": "FP8", "shape": [1]}]}
    with pytest.raises(ValueError, match="input 'x' has datatype FP8; allowed: BOOL, UINT8"):
        resolve_inputs(bad)
    with pytest.raises(ValueError, match="model metadata has no inputs"):
        resolve_inputs({"name": "m", "inputs": []})


@pytest.mark.parametrize("datatype", sorted(NUMPY_DTYPES))
def test_random_tensor_has_the_declared_type_and_shape(datatype: str) -> None:
    array = random_tensor(TensorShape("t", datatype, (2, 3)), np.random.default_rng(0))
    assert array.shape == (2, 3)
    assert array.dtype == NUMPY_DTYPES[datatype]
    if datatype == "BYTES":
        assert all(isinstance(v, bytes) for v in array.ravel())


def test_json_body_is_a_flat_v2_request() -> None:
    inputs = resolve_inputs(METADATA, batch_size=2, dynamic_size=3)
    rng = np.random.default_rng(1)
    arrays = [random_tensor(spec, rng) for spec in inputs]
    body = orjson.loads(json_body(inputs, arrays, ["y"]))
    assert [t["name"] for t in body["inputs"]] == ["x", "ids", "fixed"]
    assert body["inputs"][0]["shape"] == [2, 16]
    assert body["inputs"][1]["datatype"] == "INT64"
    np.testing.assert_array_equal(
        np.asarray(body["inputs"][0]["data"], np.float32), arrays[0].ravel()
    )
    assert body["inputs"][2]["data"] == arrays[2].ravel().tolist()
    assert body["outputs"] == [{"name": "y"}]


def test_binary_body_header_and_blobs() -> None:
    inputs = [TensorShape("x", "FP32", (2, 2)), TensorShape("s", "BYTES", (2,))]
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    s = np.array([b"ab", b""], dtype=np.object_)
    body, header_length = binary_body(inputs, [x, s], ["y"])
    header = orjson.loads(body[:header_length])
    assert header["inputs"][0]["parameters"] == {"binary_data_size": 16}
    assert header["inputs"][1]["parameters"] == {"binary_data_size": 4 + 2 + 4}
    assert header["outputs"] == [{"name": "y", "parameters": {"binary_data_output": True}}]
    blobs = body[header_length:]
    np.testing.assert_array_equal(np.frombuffer(blobs[:16], "<f4").reshape(2, 2), x)
    assert blobs[16:] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float16, np.int64, np.uint8, np.bool_, np.float64]),
        shape=hnp.array_shapes(max_dims=3, max_side=5),
    )
)
def test_raw_bytes_round_trip(array: np.ndarray) -> None:
    decoded = np.frombuffer(raw_bytes(array), dtype=array.dtype.newbyteorder("<"))
    np.testing.assert_array_equal(decoded.reshape(array.shape), array)


def test_repeat_fraction_extremes_and_shared_pool() -> None:
    inputs = resolve_inputs(METADATA)
    always = PayloadFactory(inputs, 1.0, seed=5, rng=np.random.default_rng(0))
    other = PayloadFactory(inputs, 1.0, seed=5, rng=np.random.default_rng(99))
    never = PayloadFactory(inputs, 0.0, seed=5, rng=np.random.default_rng(0))
    assert len(always.pool) == REPEATED_POOL_SIZE
    for mine, theirs in zip(always.pool, other.pool, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)  # same seed: same inputs on every worker
    assert all(always.next_arrays()[1] for _ in range(50))
    assert not any(never.next_arrays()[1] for _ in range(50))


def test_repeat_fraction_is_honoured() -> None:
    factory = PayloadFactory(resolve_inputs(METADATA), 0.3, seed=0, rng=np.random.default_rng(7))
    repeated = sum(factory.next_arrays()[1] for _ in range(4000))
    # Binomial(4000, 0.3): mean 1200, sd ~29; 5 sd either side.
    assert 1055 < repeated < 1345


def test_fresh_inputs_differ() -> None:
    factory = PayloadFactory(resolve_inputs(METADATA), 0.0, seed=0)
    first, _ = factory.next_arrays()
    second, _ = factory.next_arrays()
    assert not np.array_equal(first[0], second[0])
