"""Sampling: greedy is argmax, top-k and top-p never pick outside their sets, a seed repeats."""

from __future__ import annotations

import numpy as np

from engine.generation.sampling import Sampler, sampling_params

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
