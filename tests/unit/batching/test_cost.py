"""The online batch cost model: exact on linear data, follows a changed machine, honest when it
cannot tell per-row from per-batch cost yet."""

from __future__ import annotations

import math

import pytest

from batching.cost import MIN_BATCHES, RECENT, BatchCost


def test_nothing_is_predicted_before_enough_batches() -> None:
    cost = BatchCost()
    for _ in range(MIN_BATCHES - 1):
        cost.observe(4, 0.01)
    assert cost.predict(4) is None
    assert cost.coefficients() is None
    cost.observe(4, 0.01)
    assert cost.predict(4) == pytest.approx(0.01)


def test_linear_costs_are_recovered_exactly() -> None:
    cost = BatchCost()
    for rows in (1, 2, 4, 8, 16, 32, 3, 7):
        cost.observe(rows, 0.002 + 0.0005 * rows)
    per_batch, per_row = cost.coefficients() or (math.nan, math.nan)
    assert per_batch == pytest.approx(0.002)
    assert per_row == pytest.approx(0.0005)
    assert cost.predict(64) == pytest.approx(0.002 + 0.0005 * 64)


def test_the_fit_follows_a_slower_machine() -> None:
    cost = BatchCost(half_life=8)
    for index in range(200):
        cost.observe(1 + index % 16, 0.001 * (1 + index % 16))
    for index in range(100):  # neighbours took the cores: every row now costs 3x
        cost.observe(1 + index % 16, 0.003 * (1 + index % 16))
    assert cost.predict(10) == pytest.approx(0.030, rel=0.01)


def test_a_cost_that_shrinks_with_rows_is_not_extrapolated_below_zero() -> None:
    cost = BatchCost()
    for rows, seconds in ((1, 0.010), (2, 0.009), (4, 0.008), (8, 0.007)):
        cost.observe(rows, seconds)
    per_batch, per_row = cost.coefficients() or (math.nan, math.nan)
    assert per_row == 0.0
    assert per_batch == pytest.approx(0.0085, rel=0.01)
    assert (cost.predict(1000) or 0) > 0


def test_all_per_row_cost_fits_through_the_origin() -> None:
    cost = BatchCost()
    for rows, seconds in ((1, 0.0005), (2, 0.0021), (4, 0.0041), (8, 0.0081)):
        cost.observe(rows, seconds)
    per_batch, per_row = cost.coefficients() or (math.nan, math.nan)
    assert per_batch >= 0.0
    assert per_row == pytest.approx(0.001, rel=0.05)


@pytest.mark.parametrize(("rows", "seconds"), [(0, 0.01), (4, -1.0), (4, math.nan), (4, math.inf)])
def test_nonsense_observations_are_ignored(rows: int, seconds: float) -> None:
    cost = BatchCost()
    cost.observe(rows, seconds)
    assert cost.batches == 0


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life"):
        BatchCost(half_life=0)


def test_one_batch_size_so_far_is_taken_per_row_so_smaller_batches_look_cheaper() -> None:
    # Only full batches of 8 were seen (a saturated queue): a smaller batch must not be predicted
    # to cost as much, or shedding could never shrink a batch until it fits.
    cost = BatchCost()
    for seconds in (0.080, 0.080, 0.080):
        cost.observe(8, seconds)
    assert cost.predict(8) == pytest.approx(0.080)
    assert cost.predict(2) == pytest.approx(0.020)


def test_one_stalled_batch_barely_moves_the_fit() -> None:
    # A batch held up by a stall (the core taken by a neighbour, a GC pause) says nothing about
    # the model. Averaged in, one 3 s batch among 48 ms ones more than doubled the fitted cost
    # for the next ~64 batches, and auto shed requests that would have met their deadlines.
    cost = BatchCost()
    for index in range(200):
        cost.observe(1 + index % 8, 0.006 * (1 + index % 8))
    cost.observe(8, 3.0)
    assert cost.predict(8) == pytest.approx(0.048, rel=0.1)  # averaged in: 0.135
    assert cost.predict(1) == pytest.approx(0.006, rel=0.25)


def test_a_machine_that_slows_past_the_stall_bound_is_still_followed() -> None:
    # Every batch now takes 10x its prediction: no stall, the machine changed. Each observation
    # counts up to STALL_FACTOR predictions, so the fit climbs geometrically and gets there.
    cost = BatchCost(half_life=8)
    for index in range(100):
        cost.observe(1 + index % 8, 0.001 * (1 + index % 8))
    for index in range(100):
        cost.observe(1 + index % 8, 0.010 * (1 + index % 8))
    assert cost.predict(8) == pytest.approx(0.080, rel=0.02)


def test_the_fastest_recent_batch_bounds_what_a_batch_can_take() -> None:
    # The fit is a mean that forgets over `half_life` batches; what the model just did is
    # faster: the least a batch may take follows the fastest of the last RECENT against the fit.
    cost = BatchCost()
    for _ in range(40):
        cost.observe(4, 0.3)
    assert cost.fastest(4) == pytest.approx(0.3)  # steady: the fit itself
    for _ in range(4):
        cost.observe(4, 0.1)
    assert (cost.predict(4) or 0.0) > 0.25
    assert cost.fastest(4) == pytest.approx(0.1, rel=0.15)
    assert cost.fastest(2) == pytest.approx(0.05, rel=0.15)
    for _ in range(RECENT):
        cost.observe(4, 10.0)  # stalls: never above the fit
    assert cost.fastest(4) == cost.predict(4)


def test_nothing_is_fastest_before_anything_is_fitted() -> None:
    cost = BatchCost()
    cost.observe(4, 0.1)
    assert cost.fastest(4) is None


@pytest.mark.parametrize(
    ("seconds", "rows"), [(0.0, 0), (0.0019, 0), (0.0025, 1), (0.0101, 16), (1.0001, 1996)]
)
def test_rows_within_a_time_inverts_the_fit(seconds: float, rows: int) -> None:
    cost = BatchCost()
    for size in (1, 2, 4, 8):
        cost.observe(size, 0.002 + 0.0005 * size)
    assert cost.rows_within(seconds) == rows


def test_rows_within_is_unbounded_when_rows_cost_nothing_or_nothing_is_fitted() -> None:
    cost = BatchCost()
    assert cost.rows_within(0.01) is None  # nothing seen yet
    for size in (1, 2, 4, 8):
        cost.observe(size, 0.004)
    assert cost.rows_within(0.01) is None  # flat: any batch takes 4 ms
    assert cost.rows_within(0.003) == 0
