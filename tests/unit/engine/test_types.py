"""engine.types: the request, response and metadata types shared by the engine and front-ends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.types import InferRequest, InferResponse, SharedTensor, TensorSpec


def test_a_tensor_spec_as_the_metadata_endpoint_shows_it() -> None:
    spec = TensorSpec("x", "FP32", (-1, 4), ("batch", None))
    assert spec.as_dict() == {"name": "x", "datatype": "FP32", "shape": [-1, 4]}


def test_axis_names_do_not_make_two_specs_differ() -> None:
    assert TensorSpec("x", "FP32", (-1, 4), ("batch", None)) == TensorSpec("x", "FP32", (-1, 4))
    assert TensorSpec("x", "FP32", (-1, 4)) != TensorSpec("x", "FP16", (-1, 4))
    assert TensorSpec("x", "FP32", (-1, 4)) != TensorSpec("x", "FP32", (-1, 5))


def test_specs_and_shared_tensors_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TensorSpec("x", "FP32", (1,)).name = "y"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SharedTensor("r", 0, 16).offset = 8  # type: ignore[misc]
    assert SharedTensor("r", 0, 16).shape == ()


def test_a_request_asks_for_every_output_of_the_latest_version_by_default() -> None:
    request = InferRequest("m", {"x": np.zeros((1, 4), np.float32)}, {"x": "FP32"})
    assert request.model_version is None
    assert request.outputs is None
    assert (request.priority, request.timeout_s, request.tenant, request.arrived) == (None,) * 4
    assert request.shared_inputs is None
    assert request.shared_outputs is None
    other = InferRequest("m", {}, {})
    request.parameters["k"] = 1
    assert other.parameters == {}  # each request its own dict


def test_a_response_carries_its_outputs_in_order() -> None:
    outputs = {"b": np.zeros(1), "a": np.ones(1)}
    response = InferResponse("m", "1", outputs, {"b": "FP64", "a": "FP64"}, id="r")
    assert list(response.outputs) == ["b", "a"]
    assert (response.id, response.parameters, response.shared_outputs) == ("r", {}, None)
