"""loadtests.benchmarks.text_pipeline: the sentences it sends and its table of each round and
precision against the limit and its target."""

from __future__ import annotations

from loadtests.benchmarks.text_pipeline import WORDS, corpus, table


def test_the_corpus_has_sentences_of_6_to_30_words() -> None:
    texts = corpus(300, seed=2)
    lengths = {len(text.split()) for text in texts}
    assert (min(lengths), max(lengths)) == (6, 30)
    assert all(word in WORDS for text in texts for word in text.split())


def test_each_precision_is_rated_against_the_limit_and_its_target() -> None:
    served = {
        "fp32": {"throughput": 950.0, "p50_us": 31_500.0,
                 "gates": {"passed": True, "cosine": 0.999991},
                 "steps": {"encoder": {"compute_share": 0.8, "rows_per_batch": 24, "queue_ms": 3}}},
        "int8": {"throughput": 1200.0, "p50_us": 25_000.0,
                 "gates": {"passed": False, "cosine": 0.98},
                 "steps": {"encoder": {"compute_share": 0.7, "rows_per_batch": 30, "queue_ms": 2}}},
    }  # fmt: skip
    report = {
        "concurrency": 32, "machine": {"date": "2026-12-07", "cpus": 2},
        "rounds": [{"round": 1, "limit": {16: 800.0, 64: 1000.0}, "served": served,
                    "direct": {"fp32": {8: 900.0}, "int8": {8: 1100.0, 32: 1150.0}}}],
    }  # fmt: skip
    lines = table(report).splitlines()
    assert (
        "| 1 | fp32 | 1,000 (64) | 900 (8) | 950 | 31.5 | 0.95x | 0.9x met | "
        "pass (cosine 0.99999) |"
    ) in lines
    assert (
        "| 1 | int8 | 1,000 (64) | 1,150 (32) | 1,200 | 25.0 | 1.20x | 1.3x missed | "
        "FAIL (cosine 0.98000) |"
    ) in lines
    assert lines[-1] == ("- round 1 int8: encoder: 70% compute, 30 rows/batch, 2 ms queued")
