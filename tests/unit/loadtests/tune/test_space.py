"""The tune space: built around the served config, candidates applied to the original config
without touching anything tune does not search, and configs sluice accepts."""

from __future__ import annotations

import json

from engine.model_config import ModelConfig
from loadtests.tune.space import AUTO, ORIGINAL, Candidate, build_space, config_json

ORIGINAL_CONFIG = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_s": 0.003, "preferred_batch_sizes": [4, 8]},
    "cache": {"enabled": True},
    "warmup": {"batch_sizes": [1, 8]},
}
TRITON = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": 3000}}


def test_the_space_is_centred_on_the_served_config() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20)
    assert space.baseline == Candidate(8, 0.003, ORIGINAL, 1, 1)
    assert space.batch_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert space.delays == (0.0, 0.0005, 0.001, 0.002, 0.003, 0.004, AUTO)
    assert space.instances == (1, 2, 3, 4)
    assert space.threads(1) == (1, 2, 3, 4)
    assert space.threads(3) == (1,)
    assert space.grid_size() == 9 * 7 * 4 * (4 + 2 + 1 + 1)


def test_the_baseline_is_the_original_config_unchanged() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20)
    assert space.config(space.baseline) == ORIGINAL_CONFIG


def test_a_candidate_changes_only_what_tune_searches() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20)
    config = space.config(Candidate(32, 0.001, "quarter+half", 2, 2))
    assert config["max_batch_size"] == 32
    assert config["dynamic_batching"] == {"max_queue_delay_s": 0.001,
                                          "preferred_batch_sizes": [8, 16]}  # fmt: skip
    assert (config["instances"], config["onnxruntime"]) == (2, {"intra_op_threads": 2})
    assert (config["cache"], config["warmup"]) == (
        ORIGINAL_CONFIG["cache"],
        {"batch_sizes": [1, 8]},
    )
    assert ORIGINAL_CONFIG["max_batch_size"] == 8  # the original is never modified
    ModelConfig(**json.loads(config_json(config)))  # sluice takes it


def test_auto_plans_against_the_slo_and_a_fixed_delay_drops_the_target() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=2, slo_ms=20)
    auto = space.config(Candidate(8, AUTO, ORIGINAL, 1, 1))
    assert auto["dynamic_batching"]["max_queue_delay_s"] == "auto"
    assert auto["dynamic_batching"]["latency_target_s"] == 0.02
    ModelConfig(**auto)
    fixed = build_space(auto, TRITON, cores=2, slo_ms=20).config(Candidate(8, 0.0, "none", 1, 1))
    assert "latency_target_s" not in fixed["dynamic_batching"]
    ModelConfig(**fixed)


def test_original_preferred_sizes_larger_than_a_smaller_batch_are_dropped() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=1, slo_ms=20)
    config = space.config(Candidate(4, 0.003, ORIGINAL, 1, 1))
    assert config["dynamic_batching"]["preferred_batch_sizes"] == [4]


def test_an_unbatched_model_only_searches_instances_and_threads() -> None:
    space = build_space({"max_batch_size": 0}, {"max_batch_size": 0}, cores=2, slo_ms=20)
    names = [name for name, _, _ in space.axes(space.baseline)]
    assert names == ["instances", "intra_op_threads"]


def test_requests_larger_than_a_batch_size_rule_it_out() -> None:
    space = build_space(ORIGINAL_CONFIG, TRITON, cores=1, slo_ms=20, request_rows=4)
    assert space.batch_sizes[0] == 4


def test_gpu_instance_groups_are_kept() -> None:
    groups = {**ORIGINAL_CONFIG, "instances": [{"count": 2, "kind": "cpu"}]}
    space = build_space(groups, TRITON, cores=4, slo_ms=20)
    assert space.instances == (2,)
    assert space.config(Candidate(16, 0.0, "none", 2, 2))["instances"] == groups["instances"]


def test_workers_are_one_more_axis_only_when_tune_owns_the_server() -> None:
    assert build_space(ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20).workers == ()
    owned = build_space(
        ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20, workers=(1, 2, 4), served_workers=3
    )
    assert owned.workers == (1, 2, 3, 4)  # the command's own count is on the axis
    assert owned.baseline.workers == 3
    assert owned.axes(owned.baseline)[0] == ("workers", (1, 2, 3, 4), True)
    plain = build_space(ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20)
    assert owned.grid_size() == 4 * plain.grid_size()


def test_workers_change_the_key_but_never_the_model_config() -> None:
    space = build_space(
        ORIGINAL_CONFIG, TRITON, cores=4, slo_ms=20, workers=(1, 2), served_workers=1
    )
    other = Candidate(8, 0.003, ORIGINAL, 1, 1, workers=2)
    assert other.key == space.baseline.key.replace("-w1", "-w2") != space.baseline.key
    assert space.config(other) == ORIGINAL_CONFIG
    assert Candidate.from_dict(other.to_dict()) == other
    old = Candidate(8, 0.003, ORIGINAL, 1, 1).to_dict()
    del old["workers"]  # results.json written before workers were searched
    assert Candidate.from_dict(old).workers is None
    assert Candidate.from_dict(old).key == "b8-d3ms-poriginal-i1-t1"
