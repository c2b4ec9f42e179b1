"""The worker hop benchmark (loadtests/benchmarks/hop.py) runs both paths on a real engine and
tabulates what it measured."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import loadtests.benchmarks.hop as hop
from loadtests.benchmarks.models import write_repository


async def test_the_hop_benchmark_measures_both_paths_at_each_concurrency(tmp_path: Path) -> None:
    threshold = gc.get_threshold()
    try:
        with tempfile.TemporaryDirectory(dir="/tmp") as sockets:  # unix socket paths are short
            rows = await hop.measure(write_repository(tmp_path), sockets, rounds=1, requests=64)
    finally:  # the benchmark tunes the collector as a server process does: not this one's
        gc.unfreeze()
        gc.set_threshold(*threshold)
    measured = {(r["path"], r["concurrency"]) for r in rows}
    assert measured == {(p, c) for p in ("direct", "remote") for c in hop.CONCURRENCY}
    assert all(r["cpu_us"] > 0 for r in rows)
    text = hop.table({"rows": rows, "machine": {}, "rounds": 1, "requests": 64})
    assert text.count("\n| ") == 1 + len(hop.CONCURRENCY)  # the header row and one per level
