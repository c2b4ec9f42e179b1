from __future__ import annotations

import pytest

from engine.limits.local import ConcurrencyGate, MemoryBackend
from engine.limits.plan import Cap, Check
from engine.limits.quota import day_window

BUCKET = Check("bucket", None, rate_per_s=2.0, burst=3.0)
DAY = Check("day", None, limit=4)


@pytest.fixture
def backend(clock, wall_clock) -> MemoryBackend:
    return MemoryBackend(clock=clock, wall_clock=wall_clock)


async def test_bucket_drains_then_refills(backend: MemoryBackend, clock) -> None:
    levels = []
    for _ in range(4):
        outcome = await backend.apply("acme", [BUCKET], 1, commit=True)
        levels.append((outcome.allowed, outcome.levels[0].level))
    assert levels == [(True, 3.0), (True, 2.0), (True, 1.0), (False, 0.0)]
    clock.advance(0.25)
    outcome = await backend.apply("acme", [BUCKET], 1, commit=True)
    assert (outcome.allowed, outcome.levels[0].level) == (False, 0.5)
    clock.advance(0.25)
    outcome = await backend.apply("acme", [BUCKET], 1, commit=True)
    assert (outcome.allowed, outcome.levels[0].level) == (True, 1.0)


async def test_quota_counts_within_the_day_and_resets_at_midnight(
    backend: MemoryBackend, wall_clock
) -> None:
    results = [(await backend.apply("acme", [DAY], 2, commit=True)).allowed for _ in range(3)]
    assert results == [True, True, False]
    outcome = await backend.apply("acme", [DAY], 1, commit=False)
    assert outcome.levels[0].level == 4
    assert outcome.levels[0].window_end_s == day_window(wall_clock.now).end_s
    wall_clock.now = day_window(wall_clock.now).end_s
    assert (await backend.apply("acme", [DAY], 2, commit=True)).levels[0].level == 0


async def test_a_refused_check_charges_none_of_the_others(backend: MemoryBackend) -> None:
    await backend.apply("acme", [DAY], 4, commit=True)
    refused = await backend.apply("acme", [BUCKET, DAY], 1, commit=True)
    assert refused.allowed is False
    again = await backend.apply("acme", [BUCKET], 1, commit=False)
    assert again.levels[0].level == 3.0


async def test_read_only_apply_charges_nothing(backend: MemoryBackend) -> None:
    for _ in range(3):
        outcome = await backend.apply("acme", [BUCKET, DAY], 1, commit=False)
        assert outcome.allowed
    assert [level.level for level in outcome.levels] == [3.0, 0]


async def test_tenants_and_models_have_separate_state(backend: MemoryBackend) -> None:
    scoped = Check("bucket", "resnet", rate_per_s=2.0, burst=3.0)
    await backend.apply("acme", [BUCKET], 3, commit=True)
    other = await backend.apply("other", [BUCKET], 1, commit=True)
    model = await backend.apply("acme", [scoped], 1, commit=True)
    assert (other.levels[0].level, model.levels[0].level) == (3.0, 3.0)


async def test_outcome_reports_the_wall_clock(backend: MemoryBackend, wall_clock) -> None:
    assert (await backend.apply("acme", [], 1, commit=True)).now_unix_s == wall_clock.now


def test_acquire_up_to_cap_then_refuse() -> None:
    gate = ConcurrencyGate()
    caps = (Cap(None, 2),)
    assert gate.try_acquire("acme", caps) is None
    assert gate.try_acquire("acme", caps) is None
    assert gate.try_acquire("acme", caps) == Cap(None, 2)
    assert gate.in_flight("acme") == 2


def test_acquire_is_all_or_nothing() -> None:
    gate = ConcurrencyGate()
    assert gate.try_acquire("acme", (Cap("resnet", 1),)) is None
    assert gate.try_acquire("acme", (Cap(None, 5), Cap("resnet", 1))) == Cap("resnet", 1)
    assert gate.in_flight("acme") == 0
    assert gate.in_flight("acme", "resnet") == 1


def test_release_frees_slots_per_tenant() -> None:
    gate = ConcurrencyGate()
    caps = (Cap(None, 1),)
    assert gate.try_acquire("acme", caps) is None
    assert gate.try_acquire("other", caps) is None
    gate.release("acme", caps)
    assert (gate.in_flight("acme"), gate.in_flight("other")) == (0, 1)
    assert gate.try_acquire("acme", caps) is None
