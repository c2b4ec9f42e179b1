"""engine.generation.generator: the cache layout read from a decoder's inputs, and what a
generator refuses before it loads anything."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.generation.config import GenerativeOptions
from engine.generation.generator import Generator, cache_layout
from engine.generation.kv_cache import CacheLayout
from engine.types import TensorSpec

IDS = [
    TensorSpec(name, "INT64", (-1, -1)) for name in ("input_ids", "attention_mask", "position_ids")
]


def _decoder(layers: int = 2, past_shape: tuple[int, ...] = (-1, 4, -1, 8)) -> Any:
    past = [
        TensorSpec(f"past_key_values.{i}.{kv}", "FP32", past_shape)
        for i in range(layers)
        for kv in ("key", "value")
    ]
    return SimpleNamespace(inputs=(*IDS, *past), run=None)


def test_the_layout_comes_from_the_past_inputs() -> None:
    assert cache_layout(_decoder(), "m") == CacheLayout(layers=2, kv_heads=4, head_dim=8)
    assert cache_layout(_decoder(layers=3), "m").layers == 3


def test_a_model_that_is_not_a_decoder_with_a_cache_is_refused() -> None:
    plain = SimpleNamespace(inputs=(TensorSpec("x", "FP32", (-1, 4)),))
    with pytest.raises(ValueError, match=r"^'m' version 1 has a generative: section but its "):
        cache_layout(plain, "'m' version 1")
    no_positions = SimpleNamespace(inputs=(IDS[0], IDS[1], *_decoder().inputs[3:]))
    with pytest.raises(ValueError, match="inputs input_ids, attention_mask, past_key_values"):
        cache_layout(no_positions, "m")


@pytest.mark.parametrize("past_shape", [(-1, -1, -1, 8), (-1, 4, -1, -1), (-1, 4, 8)])
def test_heads_and_head_dim_must_be_fixed(past_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"past_key_values\.0\.key has shape .*expected"):
        cache_layout(_decoder(past_shape=past_shape), "m")


@pytest.mark.parametrize("context_length", [0, 1])
def test_a_decoder_run_by_sluice_needs_its_context_length(
    context_length: int, tmp_path: Path
) -> None:
    options = GenerativeOptions(context_length=context_length)
    with (
        ThreadPoolExecutor(1) as executor,
        pytest.raises(ValueError, match=r"generative\.context_length must be set"),
    ):
        Generator(_decoder(), options, tmp_path, executor, "m")
