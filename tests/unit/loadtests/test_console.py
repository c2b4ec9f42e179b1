from __future__ import annotations

import io

from rich.console import Console

from loadtests.console import ProgressDisplay, print_summary
from loadtests.runner import Progress
from tests.unit.loadtests.samples import result, step


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=160, force_terminal=False, color_system=None), buffer


def test_progress_shows_rate_latency_and_failures() -> None:
    console, buffer = _console()
    with ProgressDisplay(console, steps=2) as display:
        display.step_started(0, 4, duration_s=10)
        display.step_progress(0, 0.5, None)
        display.step_progress(0, 1.0, Progress(users=4, requests=100, failures=0, p99_ms=None))
        display.step_progress(0, 2.0, Progress(users=4, requests=400, failures=3, p99_ms=7.0))
        status = display.progress.tasks[0].fields["status"]
        assert status == "300 req/s · p99 7 ms · 400 req · 3 failed"
        finished = step(0, 4, 300.0, 7.0)
        finished.meets_slo = True
        display.step_finished(finished)
    assert "step 1/2 · 4 users" in buffer.getvalue()
    assert "300 ok req/s · p99 7 ms · 0 failed · SLO ok" in buffer.getvalue()


def test_summary_table_and_verdict() -> None:
    console, buffer = _console()
    run = result([step(0, 2, 123.4, 9.0)])
    run.best_step = 0
    print_summary(console, run, "out")
    text = buffer.getvalue()
    assert "123.4" in text
    assert "Highest throughput: 123.4 ok req/s at 2 users (p99 9.0 ms)." in text
    assert "out/report.md" in text
