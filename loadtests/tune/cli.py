"""`sluice tune`: find the model config with the highest throughput within a p99 SLO on a running
server (started with `--model-control-mode explicit`), and write it with a report. With
`--serve-cmd` tune starts that server itself, restarting it per front-end workers count, and
stops it however the tune ends.

Exit status: 0 a winner was written, 1 no candidate met the SLO, 2 bad usage, 3 the tune could
not run (server unreachable, not in explicit mode, locust failed, the folder cannot be resumed),
130 interrupted (after restoring the original config and writing what was measured).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from loadtests.cli import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_SLO_MISSED,
    batch_size_option,
    default_grpc_target,
    grpc_url_option,
    max_error_fraction_option,
    protocol_option,
    timeout_option,
)
from loadtests.harness import LoadTestConfig
from loadtests.plan import parse_ramp
from loadtests.runner import LoadTestError
from loadtests.tune.report import write_report
from loadtests.tune.results import ResumeError, TuneRun, load_saved
from loadtests.tune.search import Search, Trial
from loadtests.tune.serve import (
    OwnedServer,
    auto_workers,
    parse_serve_cmd,
    parse_workers_range,
    served_workers,
)
from loadtests.tune.server import ServerControl
from loadtests.tune.space import Candidate, build_space

RESERVE_S = 5.0
"""Budget kept back for restoring the original config and writing the report."""


class Progress:
    """One line per candidate: n of the planned count, its result, the best so far."""

    def __init__(self, console: Console, budget_s: float) -> None:
        self._console = console
        self._budget_s = budget_s
        self._started = time.monotonic()

    def trial_started(self, index: int, planned: int, candidate: Candidate) -> None:
        spent = time.monotonic() - self._started
        self._console.print(
            f"candidate {index} of at most {planned} [{spent:.0f} of {self._budget_s:g} s]: "
            f"{candidate.describe()}"
        )

    def trial_finished(self, trial: Trial, best: Trial | None) -> None:
        if trial.error is not None:
            outcome = f"failed: {trial.error}"
        elif trial.passed:
            outcome = f"{trial.ok_rps:,.1f} req/s at p99 {trial.p99_ms or 0:,.1f} ms"
        else:
            outcome = "no step met the SLO"
        shown = f"{best.ok_rps:,.1f} req/s ({best.candidate.key})" if best else "none yet"
        earlier = " (measured by the earlier run)" if trial.reused else ""
        self._console.print(f"  #{trial.index} {trial.phase}: {outcome}{earlier}; best: {shown}")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM: end like Ctrl-C, restoring the original config


@click.command("tune")
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Server HTTP base URL (repository API, metadata, /metrics).",
)
@click.option("--model", required=True, help="Model to tune.")
@click.option(
    "--slo-p99-ms",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    help="p99 latency SLO: candidates are ranked by throughput within it.",
)
@protocol_option
@grpc_url_option
@click.option(
    "--budget-s",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Seconds the tune may take; no trial starts that would not fit.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tune-report"),
    show_default=True,
    help="Report folder; a folder holding an earlier run of the same settings is "
    "resumed (finished candidates are not measured again).",
)
@click.option(
    "--ramp",
    default="1:64:x4",
    show_default=True,
    help="Concurrency of each trial's steps, START:STOP:STEP.",
)
@click.option(
    "--trial-s",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Seconds per concurrency step of a trial.",
)
@click.option(
    "--cores",
    type=click.IntRange(min=1),
    default=None,
    help="Cores the server may use (instances x threads), default this machine's.",
)
@batch_size_option
@max_error_fraction_option
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="API key (repeatable); the first one needs the admin role for the repository.",
)
@timeout_option
@click.option(
    "--serve-cmd",
    default=None,
    help="Command that serves --url in explicit mode (e.g. 'sluice serve --model-repository R "
    "--model-control-mode explicit --load-model M'): tune starts it, restarts it with each "
    "--workers count it tries, and stops it at the end; without it, --url is a running server "
    "and workers are not searched.",
)
@click.option(
    "--workers-range",
    default=None,
    help="Front-end worker counts to try with --serve-cmd, START:STOP or A,B,... "
    "[default: 1 to what --workers auto picks on --cores (at most 8)]",
)
@click.option(
    "--serve-ready-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="How long the --serve-cmd server may take to get ready at each start.",
)
def tune(
    url: str,
    model: str,
    slo_p99_ms: float,
    protocol: str,
    grpc_url: str | None,
    budget_s: float,
    out: Path,
    ramp: str,
    trial_s: int,
    cores: int | None,
    batch_size: int,
    max_error_fraction: float,
    api_keys: tuple[str, ...],
    timeout_s: float,
    serve_cmd: str | None,
    workers_range: str | None,
    serve_ready_timeout_s: float,
) -> None:
    """Tune a model's batching, instances and threads for throughput within a p99 SLO.

    Reloads the model with candidate configs through the repository API of a server started
    with --model-control-mode explicit, load-tests each at increasing concurrency, restores the
    original config at the end (or on Ctrl-C), and writes --out: config.yaml (the winner),
    report.md, report.html, results.json and plots. With --serve-cmd it starts the server
    itself and searches its --workers too (the winner's count goes to server.yaml).
    """
    console = Console(stderr=True, soft_wrap=True)  # one line per event, even in logs
    try:
        users = parse_ramp(ramp)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--ramp") from None
    settings: dict[str, Any] = {
        "url": url.rstrip("/"),
        "model": model,
        "protocol": protocol,
        "slo_p99_ms": slo_p99_ms,
        "budget_s": budget_s,
        "users": users,
        "trial_s": trial_s,
        "cores": cores or os.cpu_count() or 1,
        "batch_size": batch_size,
    }
    server = None
    if serve_cmd is not None:
        try:
            argv = parse_serve_cmd(serve_cmd)
            settings["served_workers"] = served_workers(argv, settings["cores"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--serve-cmd") from None
        try:
            counts = (
                parse_workers_range(workers_range)
                if workers_range is not None
                else tuple(range(1, auto_workers(settings["cores"]) + 1))
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--workers-range") from None
        settings["serve_cmd"], settings["workers"] = serve_cmd, list(counts)
        server = OwnedServer(argv, settings["url"], out / "server.log", serve_ready_timeout_s)
    elif workers_range is not None:
        raise click.BadParameter(
            "needs --serve-cmd: workers are a server setting, searched only on a server tune "
            "starts itself",
            param_hint="--workers-range",
        )
    headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else {}
    control = ServerControl(url, model, headers)
    load = LoadTestConfig(
        url=settings["url"],
        model=model,
        protocol=protocol,
        users=users,
        duration_s=trial_s,
        out=out,
        grpc_target=(grpc_url or default_grpc_target(url)) if protocol == "grpc" else None,
        batch_size=batch_size,
        api_keys=api_keys,
        slo_p99_ms=slo_p99_ms,
        max_error_fraction=max_error_fraction,
        timeout_s=timeout_s,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = _run(console, control, load, settings, out, server)
    finally:
        try:
            if server is not None:
                server.stop()  # whatever ended the tune: nothing it started outlives it
        finally:
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code)


def _run(
    console: Console,
    control: ServerControl,
    load: LoadTestConfig,
    settings: dict[str, Any],
    out: Path,
    server: OwnedServer | None = None,
) -> int:
    from loadtests.tune.trial import HarnessTrials

    started = time.monotonic()
    try:
        if server is not None:
            server.check_port_free()
            console.print(f"starting the server: {settings['serve_cmd']}")
            server.ensure(settings["served_workers"])
        saved = load_saved(out, settings)
        if saved is not None:
            original, done = saved
            console.print(f"resuming {out}: {len(done)} trial(s) measured before")
            control.restore(original)  # a run killed hard may have left a candidate loaded
        else:
            original, done = control.original(), []
        space = build_space(
            original.config,
            control.triton_config(),
            settings["cores"],
            settings["slo_p99_ms"],
            settings["batch_size"],
            workers=settings.get("workers", ()),
            served_workers=settings.get("served_workers"),
        )
    except (LoadTestError, ResumeError) as exc:
        console.print(Text("tune failed: ", style="bold red") + Text(str(exc)))
        return EXIT_FAILED
    except KeyboardInterrupt:
        console.print("interrupted before the first trial")
        return EXIT_INTERRUPTED
    run = TuneRun(
        settings=settings,
        original=original,
        space={
            "batch_sizes": list(space.batch_sizes),
            "delays": list(space.delays),
            "preferred": list(space.preferred),
            "instances": list(space.instances),
            "cores": space.cores,
            "grid_size": space.grid_size(),
            "workers": list(space.workers),
        },
        baseline=space.baseline.key,
    )

    def saved_trial(trial: Trial) -> None:
        run.trials = list(search.trials)
        run.reused = search.reused
        run.save(out)

    search = Search(
        space,
        HarnessTrials(control, load, out, server, original),
        settings["budget_s"] - RESERVE_S - (time.monotonic() - started),
        done=done,
        observer=Progress(console, settings["budget_s"]),
        on_trial=saved_trial,
        # locust takes a second or two to start each step, and the load itself a second
        expected_trial_s=len(load.users) * (load.duration_s + 2.0) + 1.0,
    )
    console.print(
        f"tuning '{settings['model']}' at p99 <= {settings['slo_p99_ms']:g} ms: at most "
        f"{search.planned()} of {space.grid_size():,} grid candidates, budget "
        f"{settings['budget_s']:g} s"
    )
    failure: str | None = None
    winner = None
    try:
        winner = search.run()
    except KeyboardInterrupt:
        run.interrupted = True
    except LoadTestError as exc:
        failure = str(exc)
    finally:
        try:
            if server is None or server.running():  # a dead owned server has nothing to restore
                control.restore(original)
                console.print("original config restored")
        except LoadTestError as exc:
            console.print(
                Text("could not restore the original config: ", style="bold red") + Text(str(exc))
            )
            failure = failure or f"restore failed: {exc}"
    run.trials = list(search.trials)
    run.reused = search.reused
    run.budget_exhausted = search.budget_exhausted
    if winner is not None and not run.interrupted:
        run.winner, run.winner_config = winner.candidate.key, winner.config
        run.winner_workers = winner.candidate.workers
    run.finished = not (run.interrupted or run.budget_exhausted or failure)
    write_report(run, out)
    if failure is not None:
        console.print(Text("tune failed: ", style="bold red") + Text(failure))
        return EXIT_FAILED
    if run.interrupted:
        console.print(f"interrupted; measured trials are in {out}/results.json (resume: rerun)")
        return EXIT_INTERRUPTED
    if run.winner is None:
        console.print(f"no candidate met the SLO; report in {out}")
        return EXIT_SLO_MISSED
    console.print(f"winner {run.winner}: {out}/config.yaml (report: {out}/report.md)")
    if run.winner_workers is not None:
        console.print(f"serve with --workers {run.winner_workers} ({out}/server.yaml)")
    return 0
