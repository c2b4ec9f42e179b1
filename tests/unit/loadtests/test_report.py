from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from loadtests.plots import PLOTS
from loadtests.report import ReportFiles, verdict_text, write_report
from loadtests.results import LoadTestResult, ServerMetrics
from tests.unit.loadtests.samples import result, server_metrics, step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _passing() -> LoadTestResult:
    steps = [
        step(0, 2, 400.0, 8.0, server=server_metrics()),
        step(
            1,
            4,
            700.0,
            12.0,
            failures=40,
            errors={"429": 30, "500": 10},
            exceptions=1,
            server=server_metrics(),
        ),
    ]
    steps[0].meets_slo, steps[1].meets_slo = True, False
    run = result(steps, slo_p99_ms=10.0)
    run.server = server_metrics()
    run.best_step, run.verdict = 0, "pass"
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> ReportFiles:
    """One report for the tests that only read it (drawing the plots takes about a second)."""
    return write_report(_passing(), tmp_path_factory.mktemp("report"))


def test_report_folder_has_every_file(report: ReportFiles) -> None:
    files = report
    assert [p.name for p in files.plots] == [plot.filename for plot, _ in PLOTS]
    for png in files.plots:
        assert png.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(files.json.read_text())
    assert LoadTestResult.from_dict(data).steps[1].errors == {"429": 30, "500": 10}
    assert data["summary"]["verdict"] == "pass"


def test_markdown_states_the_answer_and_the_breakdowns(report: ReportFiles) -> None:
    markdown = report.markdown.read_text()
    assert "**PASS**: highest throughput with p99 ≤ 10 ms is 400.0 ok req/s at 2 users" in markdown
    assert "Unexpected errors: 11." in markdown  # 10 x 500 + 1 exception, 429s excluded
    assert "| 429 | backpressure | 0 | 30 |" in markdown
    assert "| 500 | unexpected | 0 | 10 |" in markdown
    assert "| exception | unexpected | 0 | 1 |" in markdown
    assert "| 4 | 700.0 | 672.0 | 3.0 | 6.0 | 12.0 | 12.0 | 1,000 | 40 | 11 | missed |" in markdown
    assert "p50 ≤ 2 rows, p99 ≤ 4 rows" in markdown
    assert "25.0% (25 hits, 75 misses; repeated inputs sent: 25%)" in markdown
    assert "slow/rate: 100" in markdown
    for plot, _ in PLOTS:
        assert f"]({plot.filename})" in markdown


def test_html_inlines_every_image(report: ReportFiles) -> None:
    page = report.html.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(PLOTS)
    assert all(base64.b64decode(image)[:8] == PNG_MAGIC for image in images)
    assert "<strong>PASS</strong>" in page
    assert "<title>Load test: demo over http</title>" in page


def test_unexported_metrics_and_failed_slo(tmp_path: Path) -> None:
    run = result([step(0, 8, 50.0, 90.0)], slo_p99_ms=20.0)
    run.steps[0].server = ServerMetrics()
    run.server = ServerMetrics()
    run.verdict = "fail"
    markdown = write_report(run, tmp_path).markdown.read_text()
    assert "**FAIL**: even the lowest step (8 users) missed p99 ≤ 20 ms (p99 90.0 ms" in markdown
    assert markdown.count("not exported") == 5
    assert "No failed requests." in markdown


def test_unreachable_metrics(tmp_path: Path) -> None:
    run = result([step(0, 1, 50.0, 1.0)])
    run.server = ServerMetrics(error="http://x/metrics answered 404")
    run.best_step = 0
    markdown = write_report(run, tmp_path).markdown.read_text()
    assert "Server metrics unavailable: http://x/metrics answered 404." in markdown
    assert "Highest throughput: 50.0 ok req/s at 1 users (p99 1.0 ms)." in markdown


def test_an_interrupted_run_says_so(tmp_path: Path) -> None:
    run = result([step(0, 1, 50.0, 1.0)])
    run.settings.users = [1, 2, 4]
    run.best_step, run.interrupted = 0, True
    markdown = write_report(run, tmp_path).markdown.read_text()
    assert "**Interrupted** after 1 of 3 steps." in markdown
    assert LoadTestResult.from_dict(run.to_dict()).interrupted is True


def test_verdict_without_steps() -> None:
    assert verdict_text(result([])) == "No step completed."


def test_a_cpu_bound_load_generator_is_called_out(tmp_path: Path) -> None:
    run = result([step(0, 1, 50.0, 1.0), step(1, 64, 90.0, 5.0)])
    run.steps[1].generator_cpu_bound = True
    run.best_step = 1
    markdown = write_report(run, tmp_path).markdown.read_text()
    assert "**Warning**: locust ran above 90% CPU at 64 users" in markdown
