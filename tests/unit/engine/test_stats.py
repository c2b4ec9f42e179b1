"""Model statistics in Triton's shape: the compute stages counted per request, as perf_analyzer
requires (compute_input, compute_infer and compute_output counts always equal)."""

from __future__ import annotations

from batching.batcher import BatchTimings
from engine.stats import ModelStats

BATCH = BatchTimings(input_s=0.001, infer_s=0.010, output_s=0.002)


def test_each_stage_counts_every_request_of_a_batch_with_its_batch_time() -> None:
    stats = ModelStats()
    stats.batch_done(rows=5, requests=3, timings=BATCH, ok=True)
    stats.batch_done(rows=1, requests=1, timings=BATCH, ok=True)
    inference = stats.triton("m", "1")["inference_stats"]
    assert inference["compute_input"] == {"count": 4, "ns": 4_000_000}
    assert inference["compute_infer"] == {"count": 4, "ns": 40_000_000}
    assert inference["compute_output"] == {"count": 4, "ns": 8_000_000}


def test_batch_stats_time_each_stage_once_per_batch() -> None:
    stats = ModelStats()
    for _ in range(2):
        stats.batch_done(rows=5, requests=3, timings=BATCH, ok=True)
    entry = stats.triton("m", "1")
    assert entry["batch_stats"] == [
        {
            "batch_size": 5,
            "compute_input": {"count": 2, "ns": 2_000_000},
            "compute_infer": {"count": 2, "ns": 20_000_000},
            "compute_output": {"count": 2, "ns": 4_000_000},
        }
    ]
    assert (entry["inference_count"], entry["execution_count"]) == (10, 2)
    assert stats.compute.count == 2
    assert abs(stats.compute.total - 0.020) < 1e-12  # /metrics: the model run of each batch


def test_a_failed_batch_counts_no_compute() -> None:
    stats = ModelStats()
    stats.batch_done(rows=2, requests=2, timings=BATCH, ok=False)
    entry = stats.triton("m", "1")
    stages = ("compute_input", "compute_infer", "compute_output")
    assert [entry["inference_stats"][s]["count"] for s in stages] == [0, 0, 0]
    assert (entry["execution_count"], entry["batch_stats"]) == (0, [])
