"""The eviction simulation (loadtests/benchmarks/eviction_sim.py) on traces small enough to
follow by hand."""

from __future__ import annotations

import pytest

from loadtests.benchmarks.eviction_sim import Outcome, mixed_sizes, simulate, zipf_trace


def test_lru_by_bytes_evicts_the_least_recently_used_until_the_new_model_fits() -> None:
    sizes = {"a": 2, "b": 2, "c": 2}
    # a b a: a hit; c evicts b (least recently used); b evicts a; a evicts c.
    outcome = simulate(list("abacba"), sizes, budget=4, rule="lru_bytes")
    assert outcome == Outcome(hits=1, misses=5, evictions=3, loaded_bytes=10)


def test_lru_by_count_holds_the_budget_over_the_mean_size_models_whatever_their_size() -> None:
    sizes = {"a": 1, "b": 1, "c": 1, "d": 9}  # mean 3: a budget of 8 is 2 models
    # c evicts a though its bytes fit: the count is full.
    assert simulate(list("abc"), sizes, 8, "lru_count").evictions == 1
    assert simulate(list("abc"), sizes, 8, "lru_bytes").evictions == 0


def test_greedy_dual_size_keeps_small_models_over_a_large_one() -> None:
    sizes = {"big": 8, "s1": 1, "s2": 1, "s3": 1}
    trace = ["big", "s1", "s2", "s3", "s1", "s2"]  # s3 needs room: GDS evicts big, LRU s1..
    gds = simulate(trace, sizes, 10, "gds")
    lru = simulate(trace, sizes, 10, "lru_bytes")
    assert gds.hits == 2  # s1, s2 stayed
    assert lru.hits == 2  # big went first here too (least recent)
    trace = ["s1", "s2", "big", "s3", "s1", "s2"]
    assert simulate(trace, sizes, 10, "gds").hits == 2  # big (lowest 1/size) goes
    assert simulate(trace, sizes, 10, "lru_bytes").hits == 0  # s1 then s2 go, then big


def test_a_model_larger_than_the_budget_is_always_a_miss() -> None:
    assert simulate(["x", "x"], {"x": 5}, 4, "lru_bytes") == Outcome(0, 2, 0, 0)


def test_the_trace_and_sizes_are_seeded_and_skewed() -> None:
    sizes = mixed_sizes(50, 1_000, 100_000)
    assert mixed_sizes(50, 1_000, 100_000) == sizes
    assert all(1_000 <= size <= 100_000 for size in sizes.values())
    trace = zipf_trace(sorted(sizes), 5_000, 1.1)
    assert trace == zipf_trace(sorted(sizes), 5_000, 1.1)
    counts = sorted((trace.count(name) for name in sizes), reverse=True)
    assert counts[0] > 10 * counts[25]  # the head is far hotter than the middle


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rule 'fifo'"):
        simulate([], {}, 1, "fifo")
