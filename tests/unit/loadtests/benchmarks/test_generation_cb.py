"""loadtests.benchmarks.generation_cb: transformers' continuous batching measured in process,
over a manager faked at the calls it makes (add_request, get_result)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loadtests.benchmarks.generation_cb import percentiles, run


@dataclass
class Result:
    request_id: int
    timestamps: list[float]
    generated_tokens: list[int]
    error: str | None = None
    finished: bool = True

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class Manager:
    """Answers each request with `tokens` tokens 10 ms apart, an unfinished result first."""

    error: str | None = None
    results: list[Result] = field(default_factory=list)

    def add_request(self, prompt: list[int], max_new_tokens: int, record_timestamps: bool) -> int:
        import time

        index = len(self.results) // 2
        now = time.perf_counter()
        stamps = [now + 0.01 * (i + 1) for i in range(max_new_tokens)]
        self.results.append(Result(index, stamps[:1], [1], finished=False))
        self.results.append(Result(index, stamps, [1] * max_new_tokens, self.error))
        return index

    def get_result(self, timeout: float) -> Result | None:
        return self.results.pop(0) if self.results else None


def test_every_prompt_runs_at_once_and_is_timed() -> None:
    report = run(Manager(), [[1, 2, 3], [4, 5, 6, 7]], tokens=4)
    assert report["generated_tokens"] == 8
    assert report["prompt_tokens"] == [3, 4]
    assert report["inter_token_s"]["p50"] == pytest.approx(0.01)
    assert report["tokens_per_s"] == pytest.approx(8 / report["seconds"])
    assert percentiles([1.0, 3.0]) == {"p50": 2.0, "p99": pytest.approx(2.98)}


def test_a_failed_request_or_a_silent_manager_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"^out of memory$"):
        run(Manager(error="out of memory"), [[1]], tokens=2)
    silent = Manager()
    silent.add_request = lambda prompt, **options: 0  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stopped answering"):
        run(silent, [[1]], tokens=2)
