"""check_request: a decoded request against the model's metadata, with precise messages."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from engine.errors import InvalidInput
from engine.types import InferRequest, TensorSpec
from engine.validate import MAX_PARAMETER_DEPTH, check_parameters, check_request, scheduling
from tests.bytecodes import bytecodes_run

LABEL = "model 'm' version 1"
TWO_IN = (TensorSpec("a", "FP32", (-1, 4)), TensorSpec("b", "INT64", (-1, 2)))
OUTS = (TensorSpec("sum", "FP32", (-1, 4)), TensorSpec("diff", "FP32", (-1, 4)))
FIXED = (TensorSpec("img", "UINT8", (2, 3)),)


def request(
    inputs: dict[str, tuple[int, ...]],
    datatypes: dict[str, str] | None = None,
    outputs: list[str] | None = None,
) -> InferRequest:
    arrays = {name: np.zeros(shape, np.float32) for name, shape in inputs.items()}
    return InferRequest("m", arrays, datatypes or {}, outputs=outputs)


def good(rows: int = 3) -> dict[str, tuple[int, ...]]:
    return {"a": (rows, 4), "b": (rows, 2)}


def types(**override: str) -> dict[str, str]:
    return {"a": "FP32", "b": "INT64", **override}


def problem(req: InferRequest, inputs: tuple[TensorSpec, ...] = TWO_IN, max_batch: int = 8) -> str:
    with pytest.raises(InvalidInput) as caught:
        check_request(req, inputs, OUTS, max_batch, LABEL)
    return caught.value.message


def test_valid_request_returns_its_rows() -> None:
    assert check_request(request(good(3), types()), TWO_IN, OUTS, 8, LABEL) == 3
    assert check_request(request(good(8), types()), TWO_IN, OUTS, 8, LABEL) == 8


def test_unbatched_model_counts_one_row() -> None:
    assert check_request(request({"img": (2, 3)}, {"img": "UINT8"}), FIXED, (), 0, LABEL) == 1


def test_unexpected_input_is_named_with_the_expected_ones() -> None:
    message = problem(request({**good(), "c": (3, 1)}, types(c="FP32")))
    assert message == f"unexpected input 'c' for {LABEL}; it takes: a, b"


def test_missing_input_is_named() -> None:
    message = problem(request({"a": (3, 4)}, {"a": "FP32"}))
    assert message == f"missing input 'b' for {LABEL}; it takes: a, b"


def test_wrong_datatype_names_both() -> None:
    message = problem(request(good(), types(b="INT32")))
    assert message == f"input 'b' has datatype INT32; {LABEL} expects INT64"


@pytest.mark.parametrize(
    ("shape", "shown"),
    [((3, 5), "[3,5]"), ((3,), "[3]"), ((3, 4, 1), "[3,4,1]"), ((), "[]")],
)
def test_shape_the_model_cannot_take_names_both_shapes(shape: tuple[int, ...], shown: str) -> None:
    message = problem(request({"a": shape, "b": (3, 2)}, types()))
    assert message == f"input 'a' has shape {shown}; {LABEL} expects [-1,4]"


def test_fixed_dims_must_match_exactly() -> None:
    message = problem(request({"img": (3, 2)}, {"img": "UINT8"}), FIXED, max_batch=0)
    assert message == f"input 'img' has shape [3,2]; {LABEL} expects [2,3]"


def test_batch_sizes_must_agree_across_inputs() -> None:
    message = problem(request({"a": (3, 4), "b": (2, 2)}, types()))
    assert "input 'b' has batch size 2 but other inputs have 3" in message


def test_batch_over_max_batch_size() -> None:
    message = problem(request(good(9), types()))
    assert message == f"batch size 9 exceeds the maximum of 8 for {LABEL}"


def test_empty_batch_is_rejected() -> None:
    assert "batch size is 0" in problem(request(good(0), types()))


def test_unknown_output_is_named_with_the_known_ones() -> None:
    message = problem(request(good(), types(), outputs=["sum", "prod"]))
    assert message == f"unknown output 'prod' requested from {LABEL}; it has: sum, diff"


def test_output_requested_twice() -> None:
    assert "requested twice" in problem(request(good(), types(), outputs=["sum", "sum"]))


def test_output_selection_that_is_valid_passes() -> None:
    assert check_request(request(good(2), types(), outputs=["diff"]), TWO_IN, OUTS, 8, LABEL) == 2


def test_undeclared_datatype_takes_the_models() -> None:
    # Inputs decoded from binary data may carry no declared datatype.
    assert check_request(request(good(1), {}), TWO_IN, OUTS, 8, LABEL) == 1


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, (None, None)),
        ({"priority": 0}, (None, None)),  # Triton: 0 means the model's default level
        ({"priority": 3, "timeout": 250_000}, (3, 0.25)),
        ({"priority": 1, "timeout": 0}, (1, None)),
    ],
)
def test_scheduling_reads_priority_and_timeout_as_triton_does(
    parameters: dict[str, int], expected: tuple[int | None, float | None]
) -> None:
    assert scheduling(parameters) == expected


UINT64_MAX = 2**64 - 1


@pytest.mark.parametrize("key", ["timeout", "priority"])
@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("18446744073709551616", "2^64 or more"),  # 2**64
        ("1180591620717411303424", "2^64 or more"),  # 2**70
        ("-9223372036854775809", "below -2^63"),  # -(2**63) - 1: rounds to -2**63 as a double
    ],
)
def test_scheduling_parameters_past_64_bits_are_out_of_range(
    key: str, text: str, shown: str
) -> None:
    # As JSON sends them: the parser reads an integer past 64 bits as a double, whose digits
    # (1.8446744073709552e+19) misstate it.
    with pytest.raises(InvalidInput) as caught:
        scheduling(orjson.loads(f'{{"{key}": {text}}}'))
    assert caught.value.message == (
        f"parameter '{key}' is out of range (0 to {UINT64_MAX}), got {shown}"
    )


@pytest.mark.parametrize("key", ["timeout", "priority"])
def test_scheduling_parameters_are_bounded_by_uint64(key: str) -> None:
    # The largest gRPC's uint64_param holds is taken; a caller's Python int past it is named.
    assert scheduling({key: UINT64_MAX}) == (
        (UINT64_MAX, None) if key == "priority" else (None, UINT64_MAX / 1e6)
    )
    with pytest.raises(InvalidInput) as caught:
        scheduling({key: UINT64_MAX + 1})
    assert caught.value.message == (
        f"parameter '{key}' is out of range (0 to {UINT64_MAX}), got {UINT64_MAX + 1}"
    )


def test_a_parameter_s_values_are_measured_in_c_not_a_python_step_each() -> None:
    """The depth walk pushed every value of a parameter onto a stack and popped it in Python:
    256 kB of `[[1],[1],...]` took 63 ms on the event loop (orjson parses it in 6), 4 MB of
    `[1,1,...]` 0.41 s. A level's values are now looked at in C passes."""
    wide = {"tag": [1] * 10_000, "other": {str(i): "x" for i in range(10_000)}}
    assert bytecodes_run(lambda: check_parameters(wide, "request")) < 1_000
    deep: Any = 1
    for _ in range(MAX_PARAMETER_DEPTH):
        deep = [deep, 2]
    check_parameters({"tag": deep}, "request")
    with pytest.raises(InvalidInput, match="parameter 'tag' is nested deeper than 32 levels"):
        check_parameters({"tag": [deep]}, "request")
