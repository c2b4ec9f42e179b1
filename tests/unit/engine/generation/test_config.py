"""engine.generation.config: the `generative:` section of a model's config.yaml."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.generation.config import GenerativeOptions


def test_defaults() -> None:
    options = GenerativeOptions()
    assert options.context_length == 0  # the model's own (onnxruntime-genai)
    assert options.eos_token_ids == []
    assert options.kv_cache_bytes == 256 << 20
    assert (options.max_running_sequences, options.max_waiting_sequences) == (32, 256)
    assert (options.prefill_chunk_tokens, options.default_max_tokens) == (256, 16)
    assert options.prefix_caching
    assert options.prefix_block_tokens == 16


def test_a_section_as_written_in_config_yaml() -> None:
    options = GenerativeOptions.model_validate(
        {"context_length": 2048, "eos_token_ids": [2, 32000], "prefix_caching": False}
    )
    assert (options.context_length, options.eos_token_ids) == (2048, [2, 32000])
    assert not options.prefix_caching


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("context_length", -1),
        ("kv_cache_bytes", 0),
        ("max_running_sequences", 0),
        ("max_running_sequences", 4097),
        ("max_waiting_sequences", -1),
        ("prefill_chunk_tokens", 0),
        ("prefix_block_tokens", 4097),
        ("default_max_tokens", 0),
    ],
)
def test_a_value_out_of_bounds_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        GenerativeOptions.model_validate({field: value})
    assert [error["loc"] for error in caught.value.errors()] == [(field,)]


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        GenerativeOptions.model_validate({"max_tokens": 64})
    assert [(e["loc"], e["type"]) for e in caught.value.errors()] == [
        (("max_tokens",), "extra_forbidden")
    ]
