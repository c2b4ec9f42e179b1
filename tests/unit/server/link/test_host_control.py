"""What the engine process answers its workers besides inference (server/link/host_control.py),
through the rig of tests/unit/server/link/rig.py: the front-end counts of every worker in the
metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.unit.server.link.rig import Rig


async def test_front_end_counts_of_every_worker_are_in_the_metrics(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(workers=2)
    await rig.start()
    try:
        first, second = await rig.remote(0), await rig.remote(1)
        first.metrics.request("demo", "1", "http", 200, 0.01)
        second.metrics.request("demo", "1", "grpc", 200, 0.01)
        second.flush_events()
        await asyncio.sleep(0)  # the engine reads the frame (it runs in this loop)
        # first's count is still pending here: it goes just before the call, on its connection.
        text = (await first.metrics.exposition()).decode()
        assert 'protocol="http",status="200",version="1"} 1.0' in text
        assert 'protocol="grpc",status="200",version="1"} 1.0' in text
        stats = await first.statistics("demo")
        assert stats["model_stats"][0]["name"] == "demo"
    finally:
        await rig.close()
