"""Sampling: greedy is argmax, top-k and top-p never pick outside their sets, a seed repeats."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from engine.errors import InvalidInput
from engine.generation.sampling import MAX_STOP_CHARS, Sampler, sampling_params

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))


def draws(params: object, n: int = 400) -> set[int]:
    sampler = Sampler(params)  # type: ignore[arg-type]
    return {sampler(LOGITS) for _ in range(n)}


def test_greedy_is_argmax() -> None:
    assert draws(sampling_params(1, temperature=0), 20) == {0}
    assert draws(sampling_params(1, top_k=1), 20) == {0}


def test_top_k_keeps_the_k_most_likely() -> None:
    assert draws(sampling_params(1, top_k=2, seed=1)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert draws(sampling_params(1, top_p=0.7, seed=1)) == {0, 1}  # 0.5 + 0.25 reaches 0.7
    assert draws(sampling_params(1, top_p=0.5, seed=1)) == {0}


def test_plain_temperature_reaches_every_token() -> None:
    assert draws(sampling_params(1, temperature=2.0, seed=3), 2000) == {0, 1, 2, 3, 4}


def test_a_tiny_temperature_is_all_but_greedy() -> None:
    for temperature in (1e-308, 5e-324):
        assert draws(sampling_params(1, temperature=temperature, seed=1), 20) == {0}


def test_a_seed_repeats_its_draws() -> None:
    first, second = Sampler(sampling_params(1, seed=9)), Sampler(sampling_params(1, seed=9))
    assert [first(LOGITS) for _ in range(50)] == [second(LOGITS) for _ in range(50)]


@pytest.mark.parametrize(
    ("key", "value", "bounds", "shown"),
    [
        ("max_tokens", 2**64, f"1 to {2**31 - 1}", "2^64 or more"),
        ("top_k", 2**70, f"0 to {2**31 - 1}", "2^64 or more"),
        ("seed", 2**64, f"0 to {2**63 - 1}", "2^64 or more"),
        ("seed", -(2**64), f"0 to {2**63 - 1}", "below -2^63"),
    ],
)
def test_integers_past_64_bits_are_out_of_range(
    key: str, value: int, bounds: str, shown: str
) -> None:
    # As JSON sends them: the parser reads them as doubles (they were "must be an integer").
    options = {"max_tokens": 1, key: orjson.loads(str(value))}
    with pytest.raises(InvalidInput) as caught:
        sampling_params(**options)
    assert caught.value.message == f"{key} must be from {bounds}; got {shown}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ('{"max_tokens": true}', f"max_tokens must be an integer from 1 to {2**31 - 1}; got true"),
        ('{"top_k": "3"}', f"top_k must be an integer from 0 to {2**31 - 1}; got '3'"),
        ('{"temperature": [1]}', "temperature must be a number from 0 to 2; got [1]"),
        ('{"stop": true}', "stop must be a string or a list of strings; got true"),
        ('{"stop": ["a", 18446744073709551616]}',
         "stop must be a string or a list of strings; got ['a', 2^64 or more]"),
        ('{"stop": {"a": null}}', "stop must be a string or a list of strings; got {'a': null}"),
    ],
)  # fmt: skip
def test_a_parameter_of_the_wrong_kind_is_named_as_sent(options: str, message: str) -> None:
    # As JSON sends them: null and true as JSON spells them (they were Python's None and True),
    # an integer past 64 bits by its side (it was the double's digits, 1.8446744073709552e+19).
    with pytest.raises(InvalidInput) as caught:
        sampling_params(**({"max_tokens": 1} | orjson.loads(options)))
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("stop", "shown"),
    [
        (["a", "b", "c", "d", "e"], "['a', 'b', 'c', 'd', 'e']"),
        (["", "a"], "['', 'a']"),
        (["x" * (MAX_STOP_CHARS + 1)], "['" + "x" * 97 + "...]"),
    ],
)
def test_stop_strings_past_their_bounds_are_refused_and_shown_cut(
    stop: list[str], shown: str
) -> None:
    # A stop string of any length was taken (each token then searched as much text) and a
    # refused list was echoed whole.
    with pytest.raises(InvalidInput) as caught:
        sampling_params(max_tokens=1, stop=stop)
    assert caught.value.message == (
        f"stop takes 1 to 4 strings of 1 to {MAX_STOP_CHARS} characters; got {shown}"
    )


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ('{"max_tokens": 0}', "max_tokens"),
        ('{"temperature": 5}', "temperature"),
        ('{"top_k": 2.5}', "top_k"),
        ('{"top_p": 0}', "top_p"),
        ('{"top_p": 2}', "top_p"),
        ('{"seed": 18446744073709551616}', "seed"),
        ('{"stop": 5}', "stop"),
        ('{"stop": ["a", "b", "c", "d", "e"]}', "stop"),
    ],
)
def test_a_refused_parameter_is_named_in_param(options: str, param: str) -> None:
    # OpenAI's error object carries it as `param` (it was always null).
    with pytest.raises(InvalidInput) as caught:
        sampling_params(**({"max_tokens": 1} | orjson.loads(options)))
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 3.0, "temperature must be from 0 to 2; got 3.0"),
        ("top_p", 1.5, "top_p must be from 0 to 1; got 1.5"),
        ("top_k", -1, "top_k must be from 0"),
        ("max_tokens", 0, "max_tokens must be from 1"),
        ("seed", "x", "seed must be an integer"),
    ],
)
def test_sampling_parameters_out_of_range_are_invalid(
    field: str, value: object, message: str
) -> None:
    params: dict[str, object] = {"max_tokens": 4, field: value}
    with pytest.raises(InvalidInput, match=message):
        sampling_params(**params)


def test_guidance_is_a_kind_and_a_grammar() -> None:
    params = sampling_params(max_tokens=1, guidance=["json_schema", '{"type": "object"}'])
    assert params.guidance == ("json_schema", '{"type": "object"}')
    assert sampling_params(max_tokens=1).guidance is None
    for wrong in (["xml", "<a/>"], ["regex"], "regex", ["regex", 5]):
        with pytest.raises(InvalidInput) as caught:
            sampling_params(max_tokens=1, guidance=wrong)
        assert caught.value.param == "guidance"
        assert caught.value.message.startswith(
            "guidance must be [kind, grammar] with kind one of json_schema, regex, lark_grammar"
        )
