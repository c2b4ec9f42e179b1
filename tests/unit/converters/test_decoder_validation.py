"""converters.decoder_validation: the ONNX decoder's greedy loops, driven here by a stand-in
decoder that always picks the token after the last one, and how token lists are compared."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from converters.decoder_validation import (
    _until_eos,
    first_difference,
    onnx_greedy,
    onnx_next_tokens,
)
from converters.hf_decoder import DecoderShape

SHAPE = DecoderShape(
    layers=1, kv_heads=1, head_dim=2, vocab=16, context_length=64, eos_token_ids=[9]
)


class NextToken:
    """A decoder whose logits pick, at each position, the token after that position's input;
    its cache grows by one position per input token, as a real decoder's does."""

    def __init__(self) -> None:
        self.feeds: list[dict[str, Any]] = []

    def run(self, feeds: dict[str, Any]) -> list[np.ndarray]:
        self.feeds.append(feeds)
        ids = feeds["input_ids"][0]
        logits = np.zeros((1, len(ids), SHAPE.vocab), np.float32)
        logits[0, np.arange(len(ids)), (ids + 1) % SHAPE.vocab] = 1.0
        grown = [
            np.concatenate([feeds[name], np.zeros((1, 1, len(ids), 2), np.float32)], axis=2)
            for name in SHAPE.past_names
        ]
        return [logits, *grown]


def test_greedy_feeds_the_prompt_once_then_one_token_with_the_cache() -> None:
    runner = NextToken()
    assert onnx_greedy(runner, SHAPE, [3, 4], steps=3) == [5, 6, 7]  # type: ignore[arg-type]
    first, second, third = runner.feeds
    assert first["input_ids"].tolist() == [[3, 4]]
    assert first["position_ids"].tolist() == [[0, 1]]
    assert first["past_key_values.0.key"].shape == (1, 1, 0, 2)
    assert second["input_ids"].tolist() == [[5]]
    assert second["position_ids"].tolist() == [[2]]
    assert second["attention_mask"].shape == (1, 3)
    assert second["past_key_values.0.value"].shape == (1, 1, 2, 2)  # the prompt's cache
    assert third["position_ids"].tolist() == [[3]]


def test_greedy_ends_with_the_first_end_of_text_token() -> None:
    assert onnx_greedy(NextToken(), SHAPE, [6], steps=10) == [7, 8, 9]  # type: ignore[arg-type]


def test_next_tokens_are_the_choice_at_every_position_in_one_run() -> None:
    runner = NextToken()
    assert onnx_next_tokens(runner, SHAPE, [1, 5, 15]) == [2, 6, 0]  # type: ignore[arg-type]
    assert len(runner.feeds) == 1


@pytest.mark.parametrize(
    ("want", "got", "first"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 7, 3], 1),
        ([1, 2, 3], [1, 2], 2),  # one side stopping earlier differs where it stopped
        ([1, 2], [1, 2, 3], 2),
        ([], [], None),
    ],
)
def test_first_difference(want: list[int], got: list[int], first: int | None) -> None:
    assert first_difference(want, got) == first


def test_tokens_are_cut_after_the_first_end_of_text_kept() -> None:
    assert _until_eos([4, 9, 5, 9], {9}) == [4, 9]
    assert _until_eos([4, 5], {9}) == [4, 5]
