"""/v1/embeddings' request checks and row handling (the route runs end to end in
tests/integration/test_openai_embeddings_e2e.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import InvalidInput
from engine.types import ModelMetadata, TensorSpec
from server.http.embeddings import (
    MAX_INPUTS,
    EmbeddingModel,
    as_embedding_model,
    options_of,
    shorten,
    texts_of,
)

TEXT = TensorSpec("text", "BYTES", (-1,))
ROWS = TensorSpec("embeddings", "FP32", (-1, 4))
MODEL = EmbeddingModel("m", "text", "embeddings", 4)


def meta(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> ModelMetadata:
    return ModelMetadata("m", ("1",), "ensemble", inputs, outputs)


def test_a_text_in_embedding_model_is_recognized() -> None:
    assert as_embedding_model(meta((TEXT,), (ROWS,))) == MODEL


@pytest.mark.parametrize(
    ("inputs", "outputs"),
    [
        ((TensorSpec("ids", "INT64", (-1, -1)),), (ROWS,)),  # an encoder step
        ((TEXT,), (ROWS, TensorSpec("labels", "BYTES", (-1,)))),  # a classifier
        ((TEXT,), (TensorSpec("ids", "INT64", (-1, -1)),)),  # a tokenizer
        ((TEXT,), (TensorSpec("e", "FP32", (-1, -1)),)),  # no fixed width
        ((TensorSpec("text", "BYTES", (-1, 2)),), (ROWS,)),
    ],
)
def test_other_models_are_not_embedding_models(
    inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
) -> None:
    assert as_embedding_model(meta(inputs, outputs)) is None


def test_input_is_a_string_or_a_list_of_strings() -> None:
    assert texts_of({"input": "a"}, "m") == ["a"]
    assert texts_of({"input": ["a", ""]}, "m") == ["a", ""]


@pytest.mark.parametrize("ids", [[1, 2], [[1, 2], [3]]])
def test_token_ids_are_refused_naming_the_model(ids: object) -> None:
    with pytest.raises(InvalidInput, match=r"^input is token ids; model 'm' takes text") as caught:
        texts_of({"input": ids}, "m")
    assert caught.value.param == "input"


def test_more_inputs_than_allowed_are_refused() -> None:
    with pytest.raises(InvalidInput, match=rf"^input has {MAX_INPUTS + 1} items; at most"):
        texts_of({"input": ["a"] * (MAX_INPUTS + 1)}, "m")


def test_a_missing_input_is_named_as_missing() -> None:
    with pytest.raises(InvalidInput, match=r"^input is required: a string or a list"):
        texts_of({}, "m")


def test_options_default_to_float_and_the_full_width() -> None:
    assert options_of({}, MODEL, matryoshka=False) == (False, 4)
    assert options_of({"encoding_format": "base64", "dimensions": 4}, MODEL, False) == (True, 4)
    assert options_of({"encoding_format": None, "dimensions": 2}, MODEL, True) == (False, 2)


@pytest.mark.parametrize(
    ("dimensions", "shown"), [(0, "0"), (5, "5"), (2.0, "2.0"), (True, "true")]
)
def test_dimensions_out_of_range_are_named_as_sent(dimensions: object, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        options_of({"dimensions": dimensions}, MODEL, matryoshka=True)
    assert caught.value.message == f"dimensions must be an integer from 1 to 4; got {shown}"


def test_shorten_renormalizes_unit_rows_only() -> None:
    unit = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    raw = np.array([3.0, 4.0, 1.0, 1.0], np.float32)  # the model does not normalize this row
    got = shorten(np.stack([unit, raw]), 2)
    np.testing.assert_allclose(got[0], [2**-0.5, 2**-0.5], rtol=1e-6)
    np.testing.assert_array_equal(got[1], [3.0, 4.0])
    full = np.stack([unit, raw])
    assert shorten(full, 4) is full
