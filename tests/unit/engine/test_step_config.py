"""A pipeline's steps: the order they run in."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.step_config import PipelineOptions
from tests.bytecodes import bytecodes_run


def chain(steps: int) -> list[dict[str, object]]:
    """A chain t0 -> t1 -> ... of `steps` steps, listed last to first."""
    return [
        {"model": f"m{i}", "inputs": {"x": f"t{i}"}, "outputs": {"y": f"t{i + 1}"}}
        for i in reversed(range(steps))
    ]


def test_steps_run_in_rounds_each_in_list_order() -> None:
    steps = [
        {"model": "late", "inputs": {"x": "b"}, "outputs": {"y": "c"}},
        {"model": "first", "inputs": {"x": "a"}, "outputs": {"y": "b"}},
        {"model": "also_first", "inputs": {"x": "a"}, "outputs": {"y": "d"}},
        {"model": "last", "inputs": {"x": "c", "z": "d"}, "outputs": {"y": "e"}},
    ]
    assert PipelineOptions.model_validate({"steps": steps}).order() == [1, 2, 0, 3]
    assert PipelineOptions.model_validate({"steps": chain(5)}).order() == [4, 3, 2, 1, 0]


def test_a_cycle_names_the_steps_in_it() -> None:
    steps = [
        {"model": "a", "inputs": {"x": "in"}, "outputs": {"y": "p"}},
        {"model": "b", "inputs": {"x": "p", "z": "r"}, "outputs": {"y": "q"}},
        {"model": "c", "inputs": {"x": "q"}, "outputs": {"y": "r"}},
    ]
    with pytest.raises(ValidationError, match="pipeline steps 'b', 'c' wait on each other"):
        PipelineOptions.model_validate({"steps": steps})


def test_the_order_costs_a_few_steps_per_pipeline_step() -> None:
    """Each round readied the steps whose inputs existed by scanning every step still waiting:
    a chain listed last to first took a round per step, 2,000 steps 0.35 s to load (a model
    config an admin's load request carries). Each step is now counted once from its
    producers."""
    options = PipelineOptions.model_validate({"steps": chain(400)})
    assert bytecodes_run(options.order) < 300 * 400  # 138 a step; 1.3 million before
