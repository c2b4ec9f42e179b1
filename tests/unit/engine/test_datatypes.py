"""Datatype and shape checks shared by every front-end."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from engine.datatypes import MAX_DIMS, MAX_ELEMENTS, check_shape, received
from engine.errors import InvalidInput
from tests.bytecodes import bytecodes_run


def rejected(shape: list[object]) -> str:
    with pytest.raises(InvalidInput) as caught:
        check_shape("x", shape)  # type: ignore[arg-type]
    return caught.value.message


@pytest.mark.parametrize(
    ("value", "shown"),
    [(2**64, "2^64 or more"), (2**70, "2^64 or more"), (-(2**64), "below -2^63")],
)
def test_a_dimension_past_64_bits_is_out_of_range(value: int, shown: str) -> None:
    # As JSON sends it: the parser reads it as a double, whose digits (1.1805916207174113e+21)
    # misstate it, and which was called a wrong kind ("must be a list of non-negative integers").
    shape = orjson.loads(f"[0, {value}]")
    assert (
        rejected(shape) == f"input 'x': shape[1] is out of range (0 to {MAX_ELEMENTS}), got {shown}"
    )


def test_a_dimension_past_64_bits_is_named_before_other_faults() -> None:
    # The whole shape is echoed for a wrong kind: it would show the double's digits again.
    shape = orjson.loads(f'[-1, "1", {2**70}]')
    assert rejected(shape).startswith("input 'x': shape[2] is out of range (0 to ")
    assert (
        rejected([-1, "1"])
        == "input 'x': shape must be a list of non-negative integers, got [-1, '1']"
    )


def test_too_many_dimensions_are_refused_before_any_is_looked_at() -> None:
    # Each dimension was checked, a Python step each, before their count: a shape of a million
    # took 98 ms (a 2 MB JSON body, or a gRPC message).
    shape = [1] * 100_000

    def check() -> None:
        with contextlib.suppress(InvalidInput):
            check_shape("x", shape)

    assert bytecodes_run(check) < 500
    assert rejected(shape) == f"input 'x': shape has 100000 dimensions; at most {MAX_DIMS}"


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        ("null", "null"),
        ("[true, false]", "[true, false]"),
        ('{"role": "user", "n": -18446744073709551616}', "{'role': 'user', 'n': below -2^63}"),
        ("[[1, [18446744073709551616]]]", "[[1, [2^64 or more]]]"),
        ("2.5", "2.5"),
        ("-7", "-7"),
    ],
)
def test_received_values_read_as_json_sent_them(sent: str, shown: str) -> None:
    assert received(orjson.loads(sent)) == shown


def test_received_values_are_cut_at_their_room() -> None:
    assert received(list(range(1000)), room=20) == "[0, 1, 2, 3, 4, 5, ...]"
    assert received("x" * 1000, room=5) == "'xxxx..."


def test_received_nesting_is_bounded_by_the_room() -> None:
    nested: list[object] = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        nested = [nested]
    shown = received(nested)
    assert shown == "[" * 50 + "...]" + "]" * 49
