"""The tune search against a synthetic machine: it finds the best candidate in far fewer trials
than the grid, re-measures finalists beside the original, confirms its pick in paired rounds,
keeps to its budget, and a resumed search measures nothing it measured before."""

from __future__ import annotations

import math
from typing import Any

import pytest

from loadtests.tune.search import CONFIRM_ROUNDS, FINALISTS, Search, StepPoint, Trial
from loadtests.tune.space import AUTO, Candidate, Space, build_space, effective

ORIGINAL = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_s": 0.002}}
TRITON = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": 2000}}


def space(cores: int = 4) -> Space:
    return build_space(ORIGINAL, TRITON, cores=cores, slo_ms=50)


def synthetic_rps(c: Candidate) -> float:
    """Unimodal along each axis: best at batch 32, delay 1 ms, 2 instances x 2 threads."""
    delay = 0.0015 if c.max_queue_delay_s == AUTO else float(c.max_queue_delay_s)
    batch = -((math.log2(c.max_batch_size) - 5) ** 2)
    wait = -(((delay - 0.001) * 1e3) ** 2)
    cores = -((c.instances - 2) ** 2) - (c.intra_op_threads - 2) ** 2
    shape = {"original": 0.0, "none": 0.0, "half": -0.5, "quarter+half": -1.0}[c.preferred]
    return 1000.0 * math.exp(0.1 * (batch + wait + cores + shape))


class Machine:
    """A fake Measure: the synthetic rate, a clock that each trial advances by `trial_s`."""

    def __init__(self, trial_s: float = 10.0, noise: dict[str, float] | None = None) -> None:
        self.now = 0.0
        self.trial_s = trial_s
        self.measured: list[tuple[str, str]] = []
        self.noise = noise or {}

    def clock(self) -> float:
        return self.now

    def __call__(self, c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        self.now += self.trial_s
        self.measured.append((phase, c.key))
        rps = synthetic_rps(c) * self.noise.get(f"{phase}:{c.key}", 1.0)
        step = StepPoint(users=16, ok_rps=rps, p99_ms=20.0, error_fraction=0.0, meets_slo=True)
        return Trial(index, phase, c, config, ok_rps=rps, p99_ms=20.0, users=16, steps=[step])


def test_the_search_finds_the_best_in_far_fewer_trials_than_the_grid() -> None:
    machine = Machine()
    search = Search(space(), machine, budget_s=10_000, clock=machine.clock)
    winner = search.run()
    assert winner is not None
    assert winner.candidate == Candidate(32, 0.001, "original", 2, 2)
    assert winner.phase == "final"
    grid = space().grid_size()
    assert len(machine.measured) <= search.planned() < grid / 10
    assert search.budget_exhausted is False


def test_the_original_and_the_finalists_are_measured_again() -> None:
    machine = Machine()
    search = Search(space(), machine, budget_s=10_000, clock=machine.clock)
    search.run()
    finals = [key for phase, key in machine.measured if phase == "final"]
    assert finals[0] == space().baseline.key
    assert len(finals) == 1 + FINALISTS


def test_a_lucky_trial_does_not_beat_the_original_it_cannot_repeat() -> None:
    # b16 measured once at 3x its rate (noise), and again at a tenth of it.
    base = space().baseline
    lucky = Candidate(16, 0.002, "original", 1, 1)
    noise = {f"search:{lucky.key}": 3.0, f"final:{lucky.key}": 0.1}
    machine = Machine(noise=noise)
    search = Search(space(cores=1), machine, budget_s=10_000, clock=machine.clock)
    winner = search.run()
    assert winner is not None
    assert winner.candidate.key != lucky.key
    assert search.worst_ok_rps(winner.candidate.key) >= search.worst_ok_rps(base.key)


BEST = Candidate(32, 0.001, "original", 2, 2)
"""The synthetic machine's best candidate (about 2x the original's rate)."""


def final_round(original_final: float) -> tuple[Search, Trial | None]:
    """A search in which the best candidate's final run comes in at 0.95x its rate and the
    original's final run at `original_final` times the best candidate's rate."""
    base = space().baseline
    margin = synthetic_rps(BEST) / synthetic_rps(base)
    noise = {f"final:{base.key}": original_final * margin, f"final:{BEST.key}": 0.95}
    machine = Machine(noise=noise)
    search = Search(space(), machine, budget_s=10_000, clock=machine.clock)
    return search, search.run()


def test_a_candidate_within_the_original_s_own_spread_does_not_win() -> None:
    # The best candidate's worse run (its final) beats the original's worse run (its search
    # trial) but not its final one, which a faster spell of the host put at 1.1x the candidate's
    # rate: the two configs' runs overlap, so the gain may be noise.
    search, winner = final_round(1.1)
    assert winner is not None
    assert winner.candidate == space().baseline
    assert search.worst_ok_rps(BEST.key) > search.worst_ok_rps(space().baseline.key)  # old pick


def test_a_candidate_beating_every_run_of_the_original_wins() -> None:
    _, winner = final_round(0.9)
    assert winner is not None
    assert winner.candidate == BEST


def test_the_pick_faces_the_original_in_paired_rounds_the_order_swapped() -> None:
    machine = Machine()
    Search(space(), machine, budget_s=10_000, clock=machine.clock).run()
    base = space().baseline.key
    rounds = [(p, k) for p, k in machine.measured if p.startswith("confirm")]
    expected = [
        ("confirm1", base),
        ("confirm1", BEST.key),
        ("confirm2", BEST.key),
        ("confirm2", base),
    ]
    assert CONFIRM_ROUNDS == 2
    assert rounds == expected


def test_a_pick_that_loses_one_paired_round_does_not_win() -> None:
    # The best candidate beats every search and final run of the original, then comes in below
    # it in the second paired round (the host slowed while it ran): the original stays.
    base = space().baseline
    margin = synthetic_rps(BEST) / synthetic_rps(base)
    machine = Machine(noise={f"confirm2:{BEST.key}": 0.9 / margin})
    search = Search(space(), machine, budget_s=10_000, clock=machine.clock)
    winner = search.run()
    assert winner is not None
    assert winner.candidate == base
    assert search.confirmed(BEST.key) is False


def test_a_budget_that_ends_in_the_paired_rounds_keeps_the_original() -> None:
    full = Machine()
    Search(space(), full, budget_s=10_000, clock=full.clock).run()
    before_rounds = len(full.measured) - 2 * CONFIRM_ROUNDS
    machine = Machine()  # room for the finals and one trial of the first round
    budget = (before_rounds + 1) * machine.trial_s + 5
    search = Search(space(), machine, budget_s=budget, clock=machine.clock)
    winner = search.run()
    assert search.budget_exhausted is True
    assert machine.measured[-1][0] == "confirm1"
    assert winner is not None
    assert winner.candidate == space().baseline


def test_the_budget_stops_before_a_trial_that_would_not_fit() -> None:
    machine = Machine(trial_s=10.0)
    search = Search(space(), machine, budget_s=35, clock=machine.clock)
    winner = search.run()
    assert search.budget_exhausted is True
    assert machine.now <= 35
    assert len(machine.measured) == 3
    assert winner is not None
    assert winner.ok_rps == max(t.ok_rps for t in search.trials)


def test_a_resumed_search_measures_only_what_is_left() -> None:
    first = Machine()
    partial = Search(space(), first, budget_s=45, clock=first.clock)
    partial.run()
    done = [Trial.from_dict(t.to_dict()) for t in partial.trials]  # as results.json keeps them
    assert len(done) == 4
    second = Machine()
    resumed = Search(space(), second, budget_s=10_000, done=done, clock=second.clock)
    winner = resumed.run()
    assert resumed.reused == 4
    assert not set(second.measured) & set(first.measured)
    whole = Machine()
    Search(space(), whole, budget_s=10_000, clock=whole.clock).run()
    assert first.measured + second.measured == whole.measured  # the same search, in two parts
    assert winner is not None
    assert winner.candidate == Candidate(32, 0.001, "original", 2, 2)


def test_a_candidate_that_fails_to_load_loses_and_the_search_goes_on() -> None:
    machine = Machine()

    def measure(c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        if c.instances == 2:
            machine.now += 1
            return Trial(index, phase, c, config, 0.0, None, None, error="load failed: boom")
        return machine(c, config, phase, index)

    search = Search(space(), measure, budget_s=10_000, clock=machine.clock)
    winner = search.run()
    assert winner is not None
    assert winner.candidate.instances != 2
    assert any(t.error == "load failed: boom" for t in search.trials)


def test_nothing_within_the_slo_means_no_winner() -> None:
    def measure(c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        return Trial(index, phase, c, config, ok_rps=0.0, p99_ms=90.0, users=None)

    assert Search(space(), measure, budget_s=10_000).run() is None


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_threads_are_searched_within_what_the_instances_leave(cores: int) -> None:
    machine = Machine()
    search = Search(space(cores), machine, budget_s=10_000, clock=machine.clock)
    search.run()
    assert all(t.candidate.instances * t.candidate.intra_op_threads <= max(cores, 1) or
               t.candidate.intra_op_threads == 1 for t in search.trials)  # fmt: skip


def test_a_trial_that_ended_early_does_not_shorten_the_next_ones_estimate() -> None:
    # The original misses the SLO at the first of three 10 s steps, so its trial stops there;
    # the next candidate runs the whole ramp. Judged by the longest trial so far alone (10 s),
    # a 30 s trial would start with 25 s left and end 5 s past the budget.
    machine = Machine(trial_s=30.0)
    baseline = space().baseline.key

    def measure(c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        if c.key == baseline:
            machine.now += 10.0
            machine.measured.append((phase, c.key))
            return Trial(index, phase, c, config, ok_rps=0.0, p99_ms=90.0, users=None)
        return machine(c, config, phase, index)

    search = Search(space(), measure, budget_s=35, clock=machine.clock, expected_trial_s=30)
    search.run()
    assert search.budget_exhausted is True
    assert machine.measured == [("search", baseline)]
    assert machine.now <= 35


def test_a_budget_too_small_for_one_trial_measures_nothing() -> None:
    machine = Machine(trial_s=10.0)
    search = Search(space(), machine, budget_s=8, clock=machine.clock, expected_trial_s=10)
    assert search.run() is None
    assert machine.measured == []
    assert search.budget_exhausted is True


def test_two_candidates_making_the_same_config_are_measured_once() -> None:
    # The original lists no preferred sizes, threads or instances, so preferred "none" (an empty
    # list written out), threads 1 and instances 1 mean the same config.
    machine = Machine()
    search = Search(space(cores=1), machine, budget_s=10_000, clock=machine.clock)
    search.run()
    searched = [key for phase, key in machine.measured if phase == "search"]
    assert not any("-pnone-" in key for key in searched)
    meanings = [effective(t.config) for t in search.trials if t.phase == "search"]
    assert len(searched) == len(set(meanings))


def test_the_original_is_not_measured_again_under_another_name() -> None:
    # Nothing beats the original, so the preferred axis is tried from it: "none" writes
    # preferred_batch_sizes [] (and threads, instances 1) where the original says nothing.
    measured: list[str] = []

    def flat(c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        measured.append(c.key)
        return Trial(index, phase, c, config, ok_rps=1000.0, p99_ms=10.0, users=4)

    Search(space(cores=1), flat, budget_s=10_000).run()
    assert not any("-pnone-" in key for key in measured)


def test_workers_are_one_coordinate_of_the_descent_not_a_product_with_the_grid() -> None:
    # Best at 2 workers. The model config is the same at every count: a search that told trials
    # apart by their config alone would measure one count and call it every count.
    def measure(c: Candidate, config: dict[str, Any], phase: str, index: int) -> Trial:
        measured.append((phase, c))
        rps = synthetic_rps(c) * {None: 1.0, 1: 1.0, 2: 1.5, 3: 1.2, 4: 0.9}[c.workers]
        return Trial(index, phase, c, config, ok_rps=rps, p99_ms=20.0, users=16)

    measured: list[tuple[str, Candidate]] = []
    Search(space(), measure, budget_s=10_000).run()
    plain = list(measured)
    measured.clear()
    owned = build_space(
        ORIGINAL, TRITON, cores=4, slo_ms=50, workers=(1, 2, 3, 4), served_workers=1
    )
    winner = Search(owned, measure, budget_s=10_000).run()
    assert winner is not None
    assert winner.candidate == Candidate(32, 0.001, "original", 2, 2, workers=2)
    searched = [c for phase, c in measured if phase == "search"]
    assert [c.workers for c in searched[:3]] == [1, 2, 3]  # 1 -> 2 (gain) -> 3 (none): stop
    assert all(c.workers == 2 for c in searched[3:])  # the rest of the descent runs on 2
    # The axis cost two trials more than the search without it (not four times the trials).
    assert len(searched) == len([c for phase, c in plain if phase == "search"]) + 2
