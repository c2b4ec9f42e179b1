"""loadtests.benchmarks.generation_scheduler: its prompts, the median round it reports and its
table, each system against transformers one request at a time."""

from __future__ import annotations

from typing import Any

from loadtests.benchmarks.generation_scheduler import STREAMS, median_round, prompts, table


def test_prompts_span_8_to_64_tokens_within_the_vocabulary() -> None:
    cases = prompts(vocab=50, seed=3)
    assert len(cases) == STREAMS
    assert (len(cases[0]), len(cases[-1])) == (8, 64)
    assert all(1 <= token < 50 for case in cases for token in case)
    assert prompts(vocab=50, seed=3) == cases


def test_the_median_round_comes_with_its_own_latencies() -> None:
    runs = [{"tokens_per_s": rate, "ttft": rate / 10} for rate in (300.0, 100.0, 200.0)]
    assert median_round(runs) == {"tokens_per_s": 200.0, "ttft": 20.0}


def test_the_table_rates_each_system_against_one_at_a_time() -> None:
    def row(rate: float) -> dict[str, Any]:
        return {"tokens_per_s": rate, "ttft_s": {"p50": 0.01, "p99": 0.02},
                "inter_token_s": {"p50": 0.001, "p99": 0.003}}  # fmt: skip

    report = {
        "streams": 16, "tokens_per_stream": [32, 32], "prompt_tokens": [8, 64], "rounds": 3,
        "results": {"transformers_one_at_a_time": row(100.0), "sluice": row(450.0)},
    }  # fmt: skip
    lines = table(report).splitlines()
    assert lines[0].startswith("Generation, 16 streams of 32 tokens, prompts 8-64 tokens")
    assert lines[-1] == "| sluice | 450 | 4.50x | 10.0 / 20.0 | 1.00 / 3.00 |"
