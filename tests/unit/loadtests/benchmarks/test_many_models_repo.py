"""loadtests/benchmarks/many_models_repo.py: the plan and trace the many-models benchmark sends,
on inputs small enough to follow by hand."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from loadtests.benchmarks.many_models_repo import (
    BYTES_PER_HIDDEN,
    Plan,
    hidden,
    make_trace,
    request_body,
    write_repository,
)


def test_the_plan_names_its_models_pipelines_and_steps_within_the_size_range() -> None:
    plan = Plan(models=5, pipelines=2, low=1000, high=50_000, seed=3)
    weights = plan.weights()
    assert sorted(weights) == [
        "m000",
        "m001",
        "m002",
        "m003",
        "m004",
        "p0_a",
        "p0_b",
        "p1_a",
        "p1_b",
    ]
    assert all(1000 <= size <= 50_000 for size in weights.values())
    assert plan.steps() == {"p0": ("p0_a", "p0_b"), "p1": ("p1_a", "p1_b")}
    assert plan.targets() == ["m000", "m001", "m002", "m003", "m004", "p0", "p1"]
    assert plan.weights() == weights  # from the seed: every run the same repository
    assert Plan(seed=1).key() != Plan(seed=2).key()


def test_a_written_mlp_has_about_the_planned_weights(tmp_path: Path) -> None:
    plan = Plan(models=1, pipelines=1, low=200_000, high=210_000)
    write_repository(tmp_path, plan)
    model = onnx.load(tmp_path / "m000" / "1" / "model.onnx")
    weights = sum(np.prod(t.dims) * 4 for t in model.graph.initializer)
    assert abs(weights - plan.weights()["m000"]) < 2 * BYTES_PER_HIDDEN
    assert "{model: p0_b, inputs: {x: H}" in (tmp_path / "p0" / "config.yaml").read_text()
    assert hidden(1) == 1


def test_request_bodies_name_the_input_of_a_model_or_a_pipeline() -> None:
    assert json.loads(request_body("m007"))["inputs"][0]["name"] == "x"
    body = json.loads(request_body("p1"))["inputs"][0]
    assert (body["name"], body["shape"], len(body["data"])) == ("X", [1, 16], 16)


def test_the_trace_is_poisson_at_the_rate_and_zipf_over_the_models() -> None:
    names = [f"m{i}" for i in range(50)]
    trace = make_trace(names, rate_rps=200, seconds=50, s=1.1, seed=0)
    assert trace == make_trace(names, rate_rps=200, seconds=50, s=1.1, seed=0)
    assert len(trace.times) == len(trace.names)
    assert abs(len(trace.times) - 10_000) < 400  # 200/s for 50 s: sd ~100
    assert trace.times == sorted(trace.times)
    assert trace.times[-1] < 50
    counts = [count for _, count in Counter(trace.names).most_common()]
    # Zipf s=1.1 over 50 models: the top one gets 1/H(50,1.1) ~ 26%, the 10th ~ 2%.
    assert 0.23 < counts[0] / len(trace.names) < 0.29
    assert 0.015 < counts[9] / len(trace.names) < 0.03
    with pytest.raises(ValueError, match="must be > 0"):
        make_trace(names, 0, 10, 1.1, 0)
