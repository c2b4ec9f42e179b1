"""The tuning benchmark's tables (tune.md), written from what loadtests/benchmarks/tune.py
measured (tune.json): each tune against the default, the confirmation rounds, and the `auto` vs
fixed delay rounds (tune_auto.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from loadtests.benchmarks.harness import spread
from loadtests.benchmarks.tune_auto import AUTO_USERS, TARGET_OVER_FLOOR


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Tuning benchmark",
        "",
        "Commands (a later one re-runs only what it names and keeps the rest): "
        + "; ".join(f"`{c}`" for c in data.get("commands", [data["command"]]))
        + f". Server on core 0 (on cores 0-1 where a row says 2 server cores), load (locust via "
        f"the harness) on core 1; {data['machine']}.",
        "",
        "## `sluice tune`: tuned vs default, req/s at the p99 SLO",
        "",
        "Both measured in the tune's final round (same run, same conditions); `all` lists every "
        "measurement of each (search, final and the tune's paired rounds).",
        "",
        "| model | server cores | SLO p99 | default req/s (p99 ms) | tuned req/s (p99 ms) | "
        "tuned / default | trials / grid | winner | all default | all tuned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in data["tune"]:
        ratio = (
            f"{t['tuned_rps'] / t['default_rps']:.2f}x"
            if t["tuned_rps"] and t["default_rps"]
            else "-"
        )
        lines.append(
            f"| {t['model']} | {t.get('server_cores', 1)} | {t['slo_p99_ms']:g} ms | "
            f"{t['default_rps'] or 0:,.0f} "
            f"({t['default_p99_ms'] or 0:.0f}) | {t['tuned_rps'] or 0:,.0f} "
            f"({t['tuned_p99_ms'] or 0:.0f}) | {ratio} | {t['trials']} / {t['grid']:,} | "
            f"`{t['winner']}` | {', '.join(f'{v:,.0f}' for v in t['default_all_rps'])} | "
            f"{', '.join(f'{v:,.0f}' for v in t['tuned_all_rps'])} |"
        )
    lines += confirm_markdown(data["tune"])
    auto = data.get("auto")
    if isinstance(auto, dict) and auto:
        lines += ["", *auto_markdown(auto)]
    for again in data.get("auto_replicates", []):
        title = f"## `auto` vs fixed 2 ms on the CNN, again: `{again['command']}`"
        lines += ["", *auto_markdown(again, title)]
    lines += ["", *data.get("notes", [])]
    return "\n".join(lines) + "\n"


def confirm_markdown(tunes: list[dict[str, Any]]) -> list[str]:
    """The confirmation rounds' table (`confirm`): each ratio taken within its round."""
    confirmed = [t for t in tunes if t.get("confirm")]
    if not confirmed:
        return []
    lines = [
        "",
        "### The default and the winner measured again, in turn",
        "",
        "After each tune, both configs are measured again as a trial measures them (reload, "
        "ramp, req/s at the SLO), the order swapped each round; tuned / default is taken within "
        "each round, then its median and range.",
        "",
        "| model | server cores | rounds | default req/s | tuned req/s | tuned / default | "
        "each round |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in confirmed:
        c = t["confirm"]
        lines.append(
            f"| {t['model']} | {t.get('server_cores', 1)} | {c['rounds']} | "
            f"{spread(c['default'], '{:,.0f}')} | "
            f"{spread(c['tuned'], '{:,.0f}')} | {spread(c['ratios'], '{:.2f}x')} | "
            + " ".join(f"{r:.2f}" for r in c["ratios"])
            + " |"
        )
    return lines


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def _spread(rows: list[dict[str, Any]], key: str, form: str) -> str:
    """`spread` of `key` over the `rows` that have it."""
    return spread([r[key] for r in rows if r.get(key) is not None], form)


def _ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:,.0f}"


def _rows(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def auto_markdown(
    auto: dict[str, Any], title: str = "## `auto` vs fixed 2 ms on the CNN"
) -> list[str]:
    """The auto vs fixed tables: closed loop, open loop (when run), and the medians compared."""
    closed, opened = auto["closed"], auto["open"]
    then = ", then a 3 s open-loop run not measured, then each open-loop rate" if opened else ""
    lines = [
        title,
        "",
        f"The CNN served with max_batch_size {auto.get('max_batch', 8)} and "
        f"{auto.get('instances', 1)} instance(s). Each round: {AUTO_USERS} closed-loop users "
        f"under each delay{then}; at each load fixed first in odd rounds, auto first in even "
        "ones. Auto's "
        f"`latency_target_s` is {TARGET_OVER_FLOOR:g} x {AUTO_USERS} users / the fixed delay's "
        "latest closed-loop req/s (a closed loop cannot average below users / throughput), "
        "which also sets the open-loop rates.",
        "",
        f"### {AUTO_USERS} closed-loop users (locust, no wait between requests)",
        "",
        "p50/p99 are locust's, over every answer (a shed 504 included).",
        "",
        "| round | delay | target s | ok req/s | p50 ms | p99 ms | shed (504) | "
        "mean batch rows | locust CPU-bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in closed:
        lines.append(
            f"| {r['round']} | {r['delay']} | {r['target_s'] or '-'} | {r['ok_rps']:,.1f} | "
            f"{_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} | {r['error_fraction']:.1%} | "
            f"{_rows(r['mean_batch_rows'])} | {r['generator_cpu_bound']} |"
        )
    for name in dict.fromkeys(r["delay"] for r in closed):
        chosen = [r for r in closed if r["delay"] == name]
        lines.append(
            f"| median | {name} | | {_median(chosen, 'ok_rps'):,.1f} | "
            f"{_ms(_median(chosen, 'p50_ms'))} | {_ms(_median(chosen, 'p99_ms'))} | "
            f"{_median(chosen, 'error_fraction'):.1%} | "
            f"{_rows(_median(chosen, 'mean_batch_rows'))} | |"
        )
    if opened:
        lines += [
            "",
            "### Fixed arrival rate (open loop: Poisson arrivals, the same schedule for both "
            "delays)",
            "",
            "Offered as a part of the fixed delay's closed-loop req/s in the round. Latency "
            "counts from each request's scheduled send; ok req/s counts 200s answered within the "
            "schedule's span, goodput those of them answered within the target.",
            "",
            "| round | load | offered req/s | delay | target s | ok req/s | goodput req/s | "
            "ok p50 ms | ok p99 ms | p99 of all answers ms | shed (504) | mean batch rows | "
            "send lag p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in opened:
            lines.append(
                f"| {r['round']} | {r['load']:g}x | {r['offered_rps']:,.1f} | {r['delay']} | "
                f"{r['target_s']} | {r['ok_rps']:,.1f} | {r['goodput_rps']:,.1f} | "
                f"{_ms(r['ok_p50_ms'])} | {_ms(r['ok_p99_ms'])} | {_ms(r['all_p99_ms'])} | "
                f"{r['shed_fraction']:.1%} | {_rows(r['mean_batch_rows'])} | "
                f"{_ms(r['send_lag_p99_ms'])} |"
            )
    lines += [
        "",
        "### Medians over the rounds (range in brackets)",
        "",
        "auto / fixed is per round (the two measured minutes apart), then its median and range.",
        "",
        "| load | fixed ok req/s | auto ok req/s | auto / fixed | fixed goodput | auto goodput | "
        "fixed p99 ms | auto p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    settings: list[tuple[str, list[dict[str, Any]], str]] = [
        (f"{AUTO_USERS} users", closed, "p99_ms")
    ]
    for part in dict.fromkeys(r["load"] for r in opened):
        chosen = [r for r in opened if r["load"] == part]
        settings.append((f"open loop {part:g}x", chosen, "ok_p99_ms"))
    for label, chosen, p99 in settings:
        by_fixed = [r for r in chosen if r["delay"] != "auto"]
        by_auto = [r for r in chosen if r["delay"] == "auto"]
        ratios = [
            {"ratio": a["ok_rps"] / f["ok_rps"]}
            for f, a in zip(by_fixed, by_auto, strict=True)
            if f["ok_rps"]
        ]
        lines.append(
            f"| {label} | {_spread(by_fixed, 'ok_rps', '{:,.1f}')} | "
            f"{_spread(by_auto, 'ok_rps', '{:,.1f}')} | {_spread(ratios, 'ratio', '{:.2f}x')} | "
            f"{_spread(by_fixed, 'goodput_rps', '{:,.1f}')} | "
            f"{_spread(by_auto, 'goodput_rps', '{:,.1f}')} | "
            f"{_spread(by_fixed, p99, '{:,.0f}')} | {_spread(by_auto, p99, '{:,.0f}')} |"
        )
    lines += [
        "",
        "p99 is over every answer in the closed loop (locust's), over the 200s in the open loop.",
    ]
    return lines
