"""The tuning benchmark's tables (loadtests/benchmarks/tune_tables.py): auto vs fixed compared round
by round, with ranges."""

from __future__ import annotations

from typing import Any

from loadtests.benchmarks.tune_tables import auto_markdown, confirm_markdown


def closed(round_: int, delay: str, ok_rps: float, p99_ms: float) -> dict[str, Any]:
    return {
        "round": round_,
        "delay": delay,
        "target_s": 0.4 if delay == "auto" else None,
        "ok_rps": ok_rps,
        "p50_ms": 200.0,
        "p99_ms": p99_ms,
        "error_fraction": 0.0,
        "errors": {},
        "generator_cpu_bound": False,
        "mean_batch_rows": 8.0,
    }


def test_auto_over_fixed_is_taken_per_round_then_its_median_and_range() -> None:
    # Round 2 ran on a host twice as fast: medians of each delay alone would say 1.5x; per
    # round, auto served 1.2x and 0.9x of the fixed delay measured beside it.
    rounds = [
        closed(1, "fixed 2 ms", 100.0, 500.0),
        closed(1, "auto", 120.0, 400.0),
        closed(2, "auto", 180.0, 300.0),
        closed(2, "fixed 2 ms", 200.0, 350.0),
    ]
    text = "\n".join(auto_markdown({"max_batch": 32, "instances": 2, "closed": rounds, "open": []}))
    assert "max_batch_size 32 and 2 instance(s)" in text
    medians = next(line for line in text.splitlines() if line.startswith("| 64 users |"))
    cells = [cell.strip() for cell in medians.split("|")[1:-1]]
    assert cells[1:4] == ["150.0 (100.0-200.0)", "150.0 (120.0-180.0)", "1.05x (0.90x-1.20x)"]
    assert cells[6:8] == ["425 (350-500)", "350 (300-400)"]
    assert "Fixed arrival rate" not in text  # no open loop was run


def test_the_confirmation_ratio_is_taken_per_round() -> None:
    # The host ran twice as fast in round 2: medians of each config alone would say 1.33x; per
    # round, the winner served 1.5x and 1.0x of the default measured beside it.
    confirmed = {"rounds": 2, "default": [100.0, 200.0], "tuned": [150.0, 200.0],
                 "ratios": [1.5, 1.0]}  # fmt: skip
    tunes = [{"model": "cnn", "server_cores": 2, "confirm": confirmed}, {"model": "mlp"}]
    rows = [line for line in confirm_markdown(tunes) if line.startswith("| cnn")]
    cells = [cell.strip() for cell in rows[0].split("|")[1:-1]]
    assert cells == ["cnn", "2", "2", "150 (100-200)", "175 (150-200)", "1.25x (1.00x-1.50x)",
                     "1.50 1.00"]  # fmt: skip
    assert not [line for line in confirm_markdown(tunes) if line.startswith("| mlp")]
    assert confirm_markdown([{"model": "mlp"}]) == []  # no confirmation run: no table
