from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from converters.errors import ConversionError
from converters.measure import Timing
from converters.report import Report, Steps, progress_bar, render
from converters.validate import DEFAULT_TOLERANCES, OutputCheck, Validation


def console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=120, highlight=False, color_system=None), buffer


def sample_report() -> Report:
    failed = OutputCheck("probabilities", 0.5, 2.0, 0.6, 0.9, None, 0)
    failed.fail("cosine 0.900000 is below 0.999")
    return Report(
        source="m.onnx",
        name="m",
        validation=Validation(
            DEFAULT_TOLERANCES["fp16"], 8, [OutputCheck("label", mismatch=0.0), failed]
        ),
        timings=[
            Timing("source", 1, 2.0, 500.0, 5),
            Timing("converted", 1, 1.0, float("inf"), 5),
        ],
        status="validation_failed",
    )


def test_json_is_strict_and_carries_the_verdict() -> None:
    data = json.loads(sample_report().to_json())
    assert data["status"] == "validation_failed"
    assert data["validation"]["passed"] is False
    assert data["validation"]["tolerances"]["atol"] == 0.01
    assert data["validation"]["outputs"][1]["reasons"] == ["cosine 0.900000 is below 0.999"]
    assert data["timings"][1]["throughput_rows_s"] is None  # inf is not JSON
    assert "Infinity" not in sample_report().to_json()


def test_render_shows_tables_failures_and_outcome() -> None:
    out, buffer = console()
    render(sample_report(), out)
    text = buffer.getvalue()
    assert "Validation on 8 rows (atol 0.01, rtol 0.01, cosine >= 0.999)" in text
    assert "probabilities" in text
    assert "FAIL" in text
    assert "✗ probabilities: cosine 0.900000 is below 0.999" in text
    assert "Performance on this machine (1 thread)" in text
    assert "Validation failed: nothing was published" in text


def test_published_report_names_the_model_path() -> None:
    report = Report(source="x", status="published", forced=True)
    report.published = {"model_path": "models/m/3/model.onnx", "version": 3}
    out, buffer = console()
    render(report, out)
    assert "Published models/m/3/model.onnx (forced despite failed validation)" in buffer.getvalue()


def test_steps_record_time_detail_and_failure() -> None:
    report = Report(source="x")
    out, buffer = console()
    with progress_bar(out) as progress:
        steps = Steps(report, progress)
        with steps.step("export") as step:
            step.detail = "opset 20"
        with pytest.raises(ConversionError), steps.step("quantize"):
            raise ConversionError("boom")
    assert [(s.name, s.detail) for s in report.steps] == [("export", "opset 20"), ("quantize", "")]
    assert all(s.seconds >= 0 for s in report.steps)
    text = buffer.getvalue()
    assert "✓ export opset 20" in text
    assert "✗ quantize" in text


def test_performance_table_says_the_runs_of_each_model_and_batch_size() -> None:
    report = Report(source="x", status="published")
    report.timings = [
        Timing("source", 1, 2.0, 500.0, 50),
        Timing("converted", 1, 1.0, 1000.0, 50),
        Timing("source", 32, 5000.0, 6.4, 3),
        Timing("converted", 32, 900.0, 35.6, 3),
    ]
    out, buffer = console()
    render(report, out)
    rows = [line.split("│")[1:4] for line in buffer.getvalue().splitlines() if "│" in line]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["source", "1", "50"],
        ["converted", "1", "50"],
        ["source", "32", "3"],
        ["converted", "32", "3"],
        ["speedup", "1", ""],
        ["speedup", "32", ""],
    ]
