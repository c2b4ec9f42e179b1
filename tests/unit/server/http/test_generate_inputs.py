"""Triton generate requests as TensorRT-LLM- and vLLM-backend clients send them, read into
sluice's sampling options (the routes run end to end in tests/integration/test_generate_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import InvalidInput
from server.http.generate_inputs import generate_request


def test_tensorrt_llm_s_ensemble_request() -> None:
    # The request TensorRT-LLM's backend documents for its ensemble model.
    body = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "",
            "stop_words": "", "pad_id": 2, "end_id": 2}  # fmt: skip
    assert generate_request(body) == ("What is machine learning?", {"max_tokens": 20, "stop": None})


def test_inputs_as_tensors_of_one_element() -> None:
    body = {
        "text_input": ["q"], "max_tokens": [16], "temperature": [0.5], "random_seed": [7],
        "stop_words": ["a", ""], "bad_words": [""], "top_k": [3], "top_p": [0.9],
        "beam_width": [1], "return_log_probs": [False], "stream": [True],
        "exclude_input_in_output": [True], "repetition_penalty": [1.0], "min_length": [1],
    }  # fmt: skip
    assert generate_request(body) == (
        "q",
        {"max_tokens": 16, "temperature": 0.5, "seed": 7, "stop": ["a"], "top_k": 3,
         "top_p": 0.9},
    )  # fmt: skip


def test_vllm_s_sampling_parameters_and_flags() -> None:
    body = {"text_input": "q", "sampling_parameters": '{"max_tokens": 8, "temperature": 0}',
            "stream": False, "exclude_input_in_output": True, "return_finish_reason": True,
            "return_num_output_tokens": True}  # fmt: skip
    assert generate_request(body) == ("q", {"max_tokens": 8, "temperature": 0})


def test_parameters_win_over_inputs() -> None:
    body = {"text_input": "q", "max_tokens": 4, "sampling_parameters": {"max_tokens": 5},
            "parameters": {"max_tokens": 6, "stream": False, "seed": 1}}  # fmt: skip
    assert generate_request(body) == ("q", {"max_tokens": 6, "seed": 1})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": [16, 32]}, "max_tokens must be one value (or a list of one); got [16, 32]"),
        ({"beam_width": 2}, "beam_width is not supported by this server (it answers one "
         "sequence of the generated text only, without log probabilities or penalties): it may "
         "be 1; got 2"),
        ({"return_log_probs": [True]}, "return_log_probs is not supported by this server (it "
         "answers one sequence of the generated text only, without log probabilities or "
         "penalties): it may be false; got [true]"),
        ({"exclude_input_in_output": False}, "exclude_input_in_output is not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"presence_penalty": False}, "presence_penalty is not supported"),
        ({"bad_words": ["x"]}, "bad_words is not supported"),
        ({"foo": 1}, "unknown generate field 'foo'; the sampling keys are max_tokens, "
         "temperature, top_p, top_k, seed, stop, random_seed, stop_words, runtime_top_k, "
         "runtime_top_p"),
        ({"parameters": {"foo": 1}}, "unknown generate parameter 'foo'"),
        ({"sampling_parameters": '{"best_of": 2}'}, "unknown generate sampling_parameters key "
         "'best_of'"),
        ({"sampling_parameters": "{"}, "sampling_parameters is not JSON"),
        ({"sampling_parameters": "[1]"}, "sampling_parameters must be a JSON object (or a string "
         "of one); got [1]"),
        ({"parameters": [1]}, "parameters must be an object; got [1]"),
    ],
)  # fmt: skip
def test_what_sluice_does_not_do_is_refused_naming_it(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        generate_request({"text_input": "q", **body})
    assert caught.value.message.startswith(message)


def test_neutral_numbers_match_as_numbers() -> None:
    for value in (0, 0.0, [0]):
        assert generate_request({"text_input": "q", "frequency_penalty": value})[1] == {}
