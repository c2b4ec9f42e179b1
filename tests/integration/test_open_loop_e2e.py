"""The open-loop generator against a real `sluice serve`: every scheduled request is sent and
answered, on the seeded schedule, with latencies counted from its scheduled send."""

from __future__ import annotations

import numpy as np

from loadtests.benchmarks.open_loop import run_open_loop
from tests.servers import ServerProcess


async def test_an_open_loop_run_sends_its_schedule_and_reads_every_answer(
    demo_server: ServerProcess,
) -> None:
    result = await run_open_loop(demo_server.url, "demo", 40.0, 1.0, warmup_s=0.5, seed=3)
    # The same seed draws the same Poisson schedule: that many requests fall after the warm-up.
    gaps = np.random.default_rng(3).exponential(1 / 40.0, size=int(40 * 1.5 * 1.5) + 16)
    expected = int(((np.cumsum(gaps) >= 0.5) & (np.cumsum(gaps) < 1.5)).sum())
    summary = result.summary(target_s=5.0)
    assert summary["statuses"] == {"200": expected}
    assert 0 < summary["ok_p50_ms"] < 5000
    assert summary["goodput_rps"] == summary["ok_rps"]
