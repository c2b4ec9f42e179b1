"""What `sluice loadtest` shows on the terminal: live progress per step, then a summary."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtests import runner
from loadtests.report import verdict_text
from loadtests.results import LoadTestResult, StepResult


class ProgressDisplay:
    """A harness `Observer` drawing one progress bar per step on stderr.

    Use as a context manager so the live display is torn down even when the run fails.
    """

    def __init__(self, console: Console, steps: int) -> None:
        self.console = console
        self.steps = steps
        self.progress = Progress(
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._tasks: dict[int, TaskID] = {}
        self._last: dict[int, tuple[float, int]] = {}

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.progress.stop()

    def step_started(self, index: int, users: int, duration_s: int) -> None:
        label = f"step {index + 1}/{self.steps} · {users} users"
        self._tasks[index] = self.progress.add_task(
            "", total=duration_s, label=label, status="starting locust…"
        )

    def step_progress(self, index: int, elapsed_s: float, progress: runner.Progress | None) -> None:
        task = self._tasks[index]
        if progress is None:
            self.progress.update(task, completed=min(elapsed_s, self._total(task)))
            return
        rate = ""
        previous = self._last.get(index)
        if previous is not None and elapsed_s > previous[0] and progress.requests >= previous[1]:
            rate = f"{(progress.requests - previous[1]) / (elapsed_s - previous[0]):,.0f} req/s · "
        if previous is None or progress.requests != previous[1]:
            self._last[index] = (elapsed_s, progress.requests)
        p99 = f"{progress.p99_ms:g} ms" if progress.p99_ms is not None else "-"
        status = f"{rate}p99 {p99} · {progress.requests:,} req · {progress.failures:,} failed"
        self.progress.update(task, completed=min(elapsed_s, self._total(task)), status=status)

    def _total(self, task: TaskID) -> float:
        return float(self.progress.tasks[task].total or 0)

    def step_finished(self, step: StepResult) -> None:
        task = self._tasks[step.index]
        slo = {True: " · SLO ok", False: " · SLO missed", None: ""}[step.meets_slo]
        status = (
            f"{step.total.ok_rps:,.0f} ok req/s · p99 {step.total.latency.p99_ms or 0:g} ms · "
            f"{step.total.failures:,} failed{slo}"
        )
        self.progress.update(task, completed=self._total(task), status=status)


def print_summary(console: Console, result: LoadTestResult, out: str) -> None:
    """The steps table and the verdict, after the run."""
    table = Table(title=f"{result.settings.model} over {result.settings.protocol}")
    for header in ("users", "ok req/s", "p50 ms", "p95 ms", "p99 ms", "failed", "unexpected"):
        table.add_column(header, justify="right")
    for step in result.steps:
        latency = step.total.latency
        table.add_row(
            str(step.users),
            f"{step.total.ok_rps:,.1f}",
            *(
                f"{v:g}" if v is not None else "-"
                for v in (latency.p50_ms, latency.p95_ms, latency.p99_ms)
            ),
            f"{step.total.failures:,}",
            f"{step.unexpected_errors:,}",
        )
    console.print(table)
    # soft_wrap: a log or a pipe gets whole lines (paths stay greppable), not 80-column pieces.
    console.print(verdict_text(result).replace("**", ""), soft_wrap=True)
    bound = [str(step.users) for step in result.steps if step.generator_cpu_bound]
    if bound:
        console.print(
            f"Warning: locust ran above 90% CPU at {', '.join(bound)} users; add --workers.",
            style="yellow",
        )
    console.print(f"Report: {out}/report.md, {out}/report.html, {out}/results.json", soft_wrap=True)
