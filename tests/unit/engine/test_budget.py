"""engine/budget.py: the books and the eviction rule, on their own."""

from __future__ import annotations

from engine.budget import Cost, MemoryBudget


def test_a_cost_is_the_growth_across_a_load_never_negative() -> None:
    assert Cost(150, {0: 70}) - Cost(100, {0: 20}) == Cost(50, {0: 50})
    assert Cost(90, {0: 10}) - Cost(100, {0: 20}) == Cost(0, {0: 0})


def test_the_victim_is_the_least_recently_used_candidate() -> None:
    budget = MemoryBudget(1000, None)
    for name, used in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        budget.of(name).last_used = used
    assert budget.victim(["a", "b", "c"]) == "b"
    assert budget.victim(["a", "c"]) == "c"  # the caller leaves out those in use
    assert budget.victim([]) is None


def test_excess_and_too_large_per_device() -> None:
    budget = MemoryBudget(1000, 500)
    budget.record("a", "1", Cost(600, {0: 300}))
    budget.record("a", "2", Cost(100, {0: 100}))
    assert budget.model_cost("a") == Cost(700, {0: 400})
    assert budget.excess(Cost(300)) is None
    assert "host: 700 bytes resident + 301 needed > 1000" in (budget.excess(Cost(301)) or "")
    assert "GPU 0: 400 bytes resident + 101 needed > 500" in (
        budget.excess(Cost(0, {0: 101})) or ""
    )
    assert budget.excess(Cost(0, {1: 500})) is None  # another GPU has its own budget
    assert budget.too_large(Cost(1000, {0: 500})) is None
    assert "1001 bytes; model_memory.host_bytes is 1000" in (budget.too_large(Cost(1001)) or "")
    budget.forget("a")
    assert budget.host_used() == 0
    assert budget.gpu_used() == {}


def test_no_budget_never_passes() -> None:
    budget = MemoryBudget(None, None)
    budget.record("a", "1", Cost(1 << 40))
    assert budget.excess(Cost(1 << 40, {0: 1 << 40})) is None
    assert budget.too_large(Cost(1 << 50)) is None


def test_max_models_counts_models_not_versions_nor_bytes() -> None:
    budget = MemoryBudget(None, None, max_models=2)
    budget.record("a", "1", Cost(1))
    budget.record("a", "2", Cost(1))
    assert budget.excess(Cost(1 << 40), "b") is None  # a (two versions) and b: two models
    budget.record("b", "1", Cost(1))
    assert budget.excess(Cost(), "b") is None  # b is resident already: still two
    assert budget.excess(Cost(1), "c") == "3 models > 2 (model_memory.max_models)"
    assert budget.excess(Cost(1)) is None  # no model named: only the bytes count
