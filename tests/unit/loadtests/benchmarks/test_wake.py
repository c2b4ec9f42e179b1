"""The wake-up benchmark (loadtests/benchmarks/wake.py) measures real round trips between two
processes and tabulates them."""

from __future__ import annotations

import os

import loadtests.benchmarks.wake as wake


def test_round_trips_are_measured_on_each_layout() -> None:
    cores = sorted(os.sched_getaffinity(0))
    rows = wake.measure(cores, rounds=1, count=50)
    layouts = [r["layout"] for r in rows]
    assert layouts == (["same core", "two cores"] if len(cores) > 1 else ["same core"])
    for row in rows:
        # A round trip is two sends and two receives: neither side can do that in no CPU time,
        # and the wall time covers at least one side's CPU.
        assert row["cpu_us"] > 0
        assert row["peer_cpu_us"] > 0
        assert row["wall_us"] >= row["cpu_us"]
    assert os.sched_getaffinity(0) == set(cores)  # the caller's cores are given back
    text = wake.table({"rows": rows, "machine": {}, "rounds": 1, "count": 50})
    assert text.count("\n| ") == 1 + len(rows)  # the header row and one per layout
