"""batching.policy: BatchPolicy, the settings a Batcher is built with."""

from __future__ import annotations

import dataclasses

import pytest

from batching.policy import AUTO, BatchPolicy


def test_defaults() -> None:
    policy = BatchPolicy(max_batch_size=8)
    assert policy.max_queue_delay_s == 0.002
    assert (policy.max_queue_size, policy.priority_levels, policy.instances) == (4096, 1, 1)
    assert policy.preferred_batch_sizes == ()
    assert dict(policy.padding) == {}
    assert policy.dispatch_when_idle
    assert policy.latency_target_s is None


@pytest.mark.parametrize(("size", "batched"), [(0, False), (1, True), (64, True)])
def test_max_batch_size_zero_runs_each_request_alone(size: int, batched: bool) -> None:
    assert BatchPolicy(max_batch_size=size).batched is batched


def test_auto_is_the_delay_that_plans_from_deadlines() -> None:
    assert AUTO == "auto"
    assert BatchPolicy(max_batch_size=8, max_queue_delay_s="auto").auto
    assert not BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0).auto
    assert not BatchPolicy(max_batch_size=8).auto


def test_a_policy_is_frozen() -> None:
    policy = BatchPolicy(max_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_batch_size = 16  # type: ignore[misc]
    assert dataclasses.replace(policy, max_batch_size=16).max_batch_size == 16
