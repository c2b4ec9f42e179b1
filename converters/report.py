"""The conversion report: what each step did and how long it took, the model's tensors, the
validation per output, latency and throughput of source and converted model, and where the
model was published. Rendered with rich for people and as JSON (`--json`) for machines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from converters.measure import Timing, speedups
from converters.validate import Validation

LOG_WIDTH = 10_000
"""Width given to a console that is not a terminal (a CI log, a pipe): rich would otherwise
assume 80 columns and cut the tables; lines are as long as their content."""


@dataclass
class StepRecord:
    """One step of the conversion; `detail` is a short note the step fills in, `failed` marks a
    step that ran to its end with a negative result (validation that did not pass)."""

    name: str
    seconds: float = 0.0
    detail: str = ""
    failed: bool = False


@dataclass
class Report:
    """Everything `sluice convert` found out; `status` is published, validation_failed,
    not_published (--dry-run) or error."""

    source: str
    name: str = ""
    source_kind: str = ""
    precision: str = "fp32"
    target: str = "onnxruntime"
    max_batch_size: int = 0
    threads: int = 1
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    validation: Validation | None = None
    validated_on: str = ""
    """The runtime and provider the converted model was validated on (the one that serves it)."""
    tensorrt: dict[str, Any] | None = None
    """For TensorRT engines: the TensorRT version, GPU, compute capability, hardware
    compatibility level, precision, profiles and builder workspace it was built for, which the
    server checks before loading it."""
    timings: list[Timing] = field(default_factory=list)
    model_bytes: int = 0
    status: str = "error"
    forced: bool = False
    published: dict[str, Any] | None = None
    error: str | None = None

    def may_publish(self, force: bool, dry_run: bool) -> bool:
        """Whether the conversion goes on to publish; when not, `status` says why (validation
        failed without --force, or --dry-run). When it does, `status` is published and `forced`
        says whether it was over a failed validation."""
        passed = self.validation is not None and self.validation.passed
        if not passed and not force:
            self.status = "validation_failed"
            return False
        if dry_run:
            self.status = "not_published"
            return False
        self.status, self.forced = "published", not passed
        return True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (non-finite floats become null)."""
        data = dataclasses.asdict(self)
        if self.validation is not None:
            data["validation"]["passed"] = self.validation.passed
        data["speedup"] = {str(b): round(s, 3) for b, s in speedups(self.timings).items()}
        return _finite(data)  # type: ignore[no-any-return]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class Steps:
    """Records steps into the report and shows each as a rich progress line."""

    def __init__(self, report: Report, progress: Progress | None = None) -> None:
        self.report = report
        self.progress = progress

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[StepRecord]:
        record = StepRecord(name)
        task = self.progress.add_task(name, total=1) if self.progress else None
        start = time.perf_counter()
        ok = False
        try:
            yield record
            ok = True
        finally:
            record.seconds = round(time.perf_counter() - start, 3)
            self.report.steps.append(record)
            if self.progress is not None and task is not None:
                mark = "[green]✓[/]" if ok and not record.failed else "[red]✗[/]"
                note = f" [dim]{record.detail}[/]" if record.detail else ""
                self.progress.update(task, completed=1, description=f"{mark} {name}{note}")


def console_for(stderr: bool = False) -> Console:
    """A console for the command's output; not a terminal, it is never cut at 80 columns."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def progress_bar(console: Console) -> Progress:
    """The progress display: a spinner, the step and its note, elapsed time."""
    return Progress(
        SpinnerColumn(finished_text=""),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    )


def render(report: Report, console: Console) -> None:
    """Print the validation and performance tables and the outcome."""
    if report.validation is not None:
        console.print(validation_table(report.validation))
        if report.validated_on:
            console.print(f"  validated on {report.validated_on}")
        for line in failures(report.validation):
            console.print(f"  [red]✗[/] {line}")
    if report.timings:
        console.print(timing_table(report.timings, report.threads))
    if report.status == "published" and report.published:
        forced = " [yellow](forced despite failed validation)[/]" if report.forced else ""
        console.print(f"[green]Published[/] {report.published['model_path']}{forced}")
    elif report.status == "validation_failed":
        console.print("[red]Validation failed[/]: nothing was published (--force publishes anyway)")
    elif report.status == "not_published":
        console.print("Dry run: nothing was published")


def validation_table(validation: Validation) -> Table:
    tol = validation.tolerances
    bounds = ", ".join(
        f"{label} {_bound(value)}"
        for label, value in (
            ("atol", tol.atol),
            ("rtol", tol.rtol),
            ("cosine >=", tol.min_cosine),
            ("L2 err <=", tol.max_norm_error),
        )
        if value is not None
    )
    table = Table(title=f"Validation on {validation.samples} rows ({bounds or 'no bounds'})")
    # fold, never "…": a narrow terminal wraps a value rather than hiding part of it.
    table.add_column("output", overflow="fold")
    for column in ("max abs", "max rel", "L2 err", "cosine", "differ", "NaN/Inf", "result"):
        table.add_column(column, justify="right", overflow="fold")
    for check in validation.outputs:
        table.add_row(
            check.name,
            _num(check.max_abs_error),
            _num(check.max_rel_error),
            _num(check.norm_error),
            None if check.cosine is None else f"{check.cosine:.6f}",
            None if check.mismatch is None else f"{check.mismatch:.2%}",
            str(check.new_nan_inf),
            "[green]pass[/]" if check.passed else "[red]FAIL[/]",
        )
    return table


def failures(validation: Validation) -> list[str]:
    """One line per failed check, saying which bound it broke."""
    return [
        f"{check.name}: {reason}"
        for check in validation.outputs
        if not check.passed
        for reason in check.reasons
    ]


def timing_table(timings: list[Timing], threads: int) -> Table:
    table = Table(title=f"Performance on this machine ({threads} thread{'s' * (threads > 1)})")
    table.add_column("model", overflow="fold")
    for column in ("batch", "runs", "p50 latency ms", "throughput rows/s"):
        table.add_column(column, justify="right", overflow="fold")
    for timing in timings:
        table.add_row(
            timing.model,
            str(timing.batch),
            str(timing.iterations),
            f"{timing.p50_ms:.3f}",
            f"{timing.throughput_rows_s:,.0f}",
        )
    for batch, ratio in speedups(timings).items():
        table.add_row("[bold]speedup[/]", str(batch), "", "", f"[bold]{ratio:.2f}x[/]")
    return table


def _bound(value: float) -> str:
    return f"{value:g}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
