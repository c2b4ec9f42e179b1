"""The tune report folder: config.yaml (the winner), server.yaml (its front-end workers, when
they were searched), results.json, report.md, report.html and two plots (each candidate's
throughput against p99 across concurrency; the front of best trade-offs over every measured
point, the winner marked)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from loadtests.plots import DPI
from loadtests.render import Block, Heading, Image, Paragraph, Table, to_html, to_markdown
from loadtests.tune.results import TuneRun
from loadtests.tune.search import CONFIRM_ROUNDS, FINALISTS, MIN_GAIN, Trial

CURVES = "candidates.png"
FRONT = "front.png"
SERVER_YAML = "server.yaml"


def front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (p99_ms, req/s) points no other point beats on both (lower p99, higher rate), by p99."""
    best: list[tuple[float, float]] = []
    for p99, rate in sorted(points, key=lambda point: (point[0], -point[1])):
        if not best or rate > best[-1][1]:
            best.append((p99, rate))
    return best


def _points(trial: Trial) -> list[tuple[float, float]]:
    return [(s.p99_ms, s.ok_rps) for s in trial.steps if s.p99_ms is not None]


def draw(run: TuneRun, out: Path) -> list[Image]:
    """Both plots into `out`."""
    slo = float(run.settings["slo_p99_ms"])
    figure = Figure(figsize=(8.0, 4.5))
    axes = figure.add_subplot()
    for trial in run.trials:
        points = _points(trial)
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        if trial.candidate.key == run.winner:
            axes.plot(xs, ys, "o-", color="tab:red", linewidth=2.5, label=f"winner {run.winner}")
        elif trial.candidate.key == run.baseline:
            axes.plot(xs, ys, "s--", color="tab:blue", linewidth=1.8, label="original")
        else:
            axes.plot(xs, ys, ".-", color="grey", alpha=0.45, linewidth=0.8)
    axes.axvline(slo, color="black", linestyle=":", label=f"SLO p99 {slo:g} ms")
    axes.set_xlabel("p99 latency (ms)")
    axes.set_ylabel("successful requests/s")
    axes.set_title("Each candidate across concurrency (grey: others)")
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(out / CURVES, dpi=DPI, format="png")

    figure = Figure(figsize=(8.0, 4.5))
    axes = figure.add_subplot()
    every = [point for trial in run.trials for point in _points(trial)]
    if every:
        xs, ys = zip(*every, strict=True)
        axes.scatter(xs, ys, s=12, color="grey", alpha=0.5, label="every step of every trial")
        edge = front([p for p in every if p[0] <= slo] or every)
        axes.plot(
            *zip(*edge, strict=True),
            "-",
            color="tab:green",
            drawstyle="steps-post",
            label="front within the SLO",
        )
    winner = next((t for t in run.trials if t.candidate.key == run.winner and t.passed), None)
    if winner is not None and winner.p99_ms is not None:
        axes.scatter(
            [winner.p99_ms],
            [winner.ok_rps],
            marker="*",
            s=260,
            color="tab:red",
            zorder=5,
            label="winner",
        )
    axes.axvline(slo, color="black", linestyle=":", label=f"SLO p99 {slo:g} ms")
    axes.set_xlabel("p99 latency (ms)")
    axes.set_ylabel("successful requests/s")
    axes.set_title("Best trade-offs")
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(out / FRONT, dpi=DPI, format="png")
    return [
        Image(CURVES, "Throughput vs p99 per candidate"),
        Image(FRONT, "Front of best trade-offs, winner marked"),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _table(run: TuneRun) -> Table:
    workers = bool(run.space.get("workers"))
    rows = []
    last = max((t.index for t in run.trials if t.candidate.key == run.winner), default=None)
    for t in run.trials:
        c = t.candidate
        delay = c.max_queue_delay_s
        mark = " **winner**" if t.index == last else ""
        verdict = t.error or ("meets SLO" if t.passed else "misses SLO")
        rows.append(
            [
                f"{t.index}{mark}",
                t.phase,
                str(c.max_batch_size),
                delay if isinstance(delay, str) else f"{delay * 1e3:g} ms",
                c.preferred,
                str(c.instances),
                str(c.intra_op_threads),
                *([str(c.workers)] if workers else []),
                f"{t.ok_rps:,.1f}",
                _ms(t.p99_ms),
                "-" if t.users is None else str(t.users),
                f"{t.seconds:.0f}",
                verdict,
            ]
        )
    headers = [
        "#",
        "phase",
        "max batch",
        "delay",
        "preferred",
        "instances",
        "threads",
        *(["workers"] if workers else []),
        "req/s at SLO",
        "p99 ms",
        "users",
        "s",
        "verdict",
    ]
    return Table(headers, rows)


def _strategy(run: TuneRun) -> str:
    grid = run.space.get("grid_size", 0)
    measured = len(run.trials)
    return (
        f"{measured} trials ({run.reused} reused from an earlier run in this folder) out of a "
        f"full grid of {grid:,} candidates. The search is coordinate descent from the original "
        "config: each axis in turn (max batch size, delay, preferred sizes, instances, ONNX "
        f"Runtime threads) climbs from the current best towards the better neighbour while "
        f"throughput at the SLO rises by more than {MIN_GAIN:.0%}; values off the order (delay "
        "`auto`, preferred-size shapes) are tried once. Throughput at a p99 SLO rises then "
        "falls along each of these axes, so a climb finds an axis's best in two to four "
        "trials, and the axes interact weakly except instances x threads, which are searched "
        "in that order within the cores. The original and the best "
        f"{FINALISTS} are then measured again in the same run and the pick is the one whose "
        "worse measurement is best, if that beats every measurement of the original (else the "
        f"original stays), so one lucky trial cannot win. The pick then faces the original in "
        f"{CONFIRM_ROUNDS} paired rounds (measured back to back, the order swapped each round) "
        "and replaces it only if it wins every round: the machine's speed drifts over minutes, "
        "and only side-by-side runs cancel the drift, so the winner is never below the original."
    )


def _workers(run: TuneRun) -> str:
    counts = run.space.get("workers") or []
    if not counts:
        return (
            "Front-end worker processes (`--workers`) are a server setting that needs a restart, "
            "which the repository API cannot do: they were not searched (pass `--serve-cmd` for "
            "tune to start the server itself and search them)."
        )
    served = run.settings.get("served_workers")
    text = (
        f"Front-end worker processes (`--workers`) were searched over "
        f"{', '.join(str(n) for n in counts)} as the first axis of the same descent (each count "
        f"tried is a server restart; every later trial runs on the chosen one): "
        f"{run.workers_trials()} search trial(s) at another count than the command's "
        f"{served}."
    )
    if run.winner_workers is not None:
        text += (
            f" Workers are a server setting, not model config: serve with "
            f"`--workers {run.winner_workers}` (`server.yaml` in this folder)."
        )
    return text


def build(run: TuneRun, plots: Sequence[Image]) -> list[Block]:
    s = run.settings
    original = next((t for t in run.trials if t.candidate.key == run.baseline), None)
    winner = next((t for t in run.trials if t.candidate.key == run.winner), None)
    if winner is None:
        verdict = f"No candidate met the p99 SLO of {s['slo_p99_ms']:g} ms."
        if any(t.passed for t in run.trials) and any(t.phase == "final" for t in run.trials):
            verdict = (
                f"No candidate met the p99 SLO of {s['slo_p99_ms']:g} ms in both its search and "
                "final measurements (the final round missed it for every finalist, the original "
                "included: the machine's load changed during the run); no config.yaml is written."
            )
    else:
        verdict = f"Winner: `{winner.candidate.key}` ({winner.candidate.describe()})."
        if run.winner_workers is not None:
            verdict += f" Serve with `--workers {run.winner_workers}` (`server.yaml`)."
        if original is not None and original.passed and run.winner != run.baseline:
            verdict += f" The original config is `{run.baseline}`."
        elif run.winner == run.baseline:
            verdict += " No candidate beat the original config."
    state = []
    if run.budget_exhausted:
        state.append(f"The budget of {s['budget_s']:g} s ended the search early.")
    if run.interrupted:
        state.append("The run was interrupted; resume it with the same command.")
    settings = [
        ["server", f"`{s['url']}`"],
        ["model", f"`{s['model']}`"],
        ["protocol", s["protocol"]],
        ["p99 SLO", f"{s['slo_p99_ms']:g} ms"],
        ["budget", f"{s['budget_s']:g} s"],
        ["users per step", ", ".join(str(u) for u in s["users"])],
        ["seconds per step", str(s["trial_s"])],
        ["cores searched", str(s["cores"])],
        ["original config from", run.original.source],
        *([["server command", f"`{s['serve_cmd']}`"]] if s.get("serve_cmd") else []),
    ]
    return [
        Heading(1, f"Tune: `{s['model']}` at p99 <= {s['slo_p99_ms']:g} ms"),
        Paragraph(verdict),
        *[Paragraph(text) for text in state],
        Table(["setting", "value"], settings),
        Heading(2, "Strategy"),
        Paragraph(_strategy(run)),
        Paragraph(_workers(run)),
        Heading(2, "Candidates"),
        _table(run),
        Heading(2, "Plots"),
        *plots,
        Paragraph(
            "The winner's config is `config.yaml` in this folder; locust's CSVs and logs "
            "for every trial are in `trials/`."
        ),
    ]


def write_report(run: TuneRun, out: Path) -> None:
    """results.json, config.yaml (when there is a winner), the plots, report.md and .html."""
    out.mkdir(parents=True, exist_ok=True)
    run.save(out)
    if run.winner_config is not None:
        header = (
            f"# sluice tune winner for model '{run.settings['model']}': {run.winner}\n"
            f"# at p99 <= {run.settings['slo_p99_ms']:g} ms; see report.md\n"
        )
        body = yaml.safe_dump(run.winner_config, sort_keys=False)
        (out / "config.yaml").write_text(header + body)
    if run.winner_config is not None and run.winner_workers is not None:
        (out / SERVER_YAML).write_text(
            f"# sluice tune winner's server setting for model '{run.settings['model']}': "
            f"serve with --workers {run.winner_workers}\n"
            f"# (or merge into the --config file you serve with); see report.md\n"
            + yaml.safe_dump({"workers": run.winner_workers})
        )
    plots = draw(run, out)
    blocks = build(run, plots)
    (out / "report.md").write_text(to_markdown(blocks))
    (out / "report.html").write_text(to_html(blocks, out))
