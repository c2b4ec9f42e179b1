"""loadtests.plots: the report's PNG plots, and what the cache plot says when it has nothing to
draw (the plots in a whole report: test_report.py)."""

from __future__ import annotations

from pathlib import Path

from loadtests.plots import PLOTS, cache_note, draw_all
from loadtests.results import ServerMetrics
from tests.unit.loadtests.samples import result, step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_zero_cache_counters_are_no_lookups_not_unexported() -> None:
    run = result([step(0, 8, 50.0, 9.0, server=ServerMetrics(cache_hits=0.0, cache_misses=0.0))])
    assert cache_note(run) == "no cache lookups (is the model's result cache enabled?)"
    run.steps[0].server = ServerMetrics()
    assert cache_note(run) == "cache counters not exported by the server"
    run.steps[0].server = ServerMetrics(cache_hits=1.0, cache_misses=3.0)
    assert cache_note(run) is None


def test_a_run_without_server_metrics_still_draws_every_plot(tmp_path: Path) -> None:
    # (A run always has a step: the harness reports none when the first is interrupted.)
    drawn = draw_all(result([step(0, 2, 400.0, 8.0)]), tmp_path)
    assert [plot.filename for plot in drawn] == [plot.filename for plot, _ in PLOTS]
    for plot in drawn:
        assert (tmp_path / plot.filename).read_bytes().startswith(PNG_MAGIC), plot.filename
