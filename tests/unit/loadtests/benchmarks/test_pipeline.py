"""loadtests.benchmarks.pipeline: the texts it sends and its table, served texts/s against the
direct limit."""

from __future__ import annotations

from loadtests.benchmarks.pipeline import WORDS, corpus, table


def test_the_corpus_has_texts_of_3_to_14_words() -> None:
    texts = corpus(200, seed=1)
    lengths = {len(text.split()) for text in texts}
    assert (min(lengths), max(lengths)) == (3, 14)
    assert all(word in WORDS for text in texts for word in text.split())
    assert corpus(200, seed=1) == texts


def test_the_table_rates_each_concurrency_against_the_best_direct_batch() -> None:
    report = {
        "texts": 1000, "machine": {"cpus": 1},
        "limits": [{"batch": 1, "texts_per_s": 200.0}, {"batch": 32, "texts_per_s": 800.0}],
        "rows": [{"concurrency": 16, "texts_per_s": 600.0,
                  "mean_batch": {"tok": 12.5, "embed": 12.5, "norm": 12.0}}],
    }  # fmt: skip
    assert table(report).splitlines()[-1] == "| 16 | 600 | 75.0% | 3.00 | 12.5 / 12.5 / 12.0 |"
