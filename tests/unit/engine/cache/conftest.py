from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.redis_proxy import HoldingProxy


@pytest.fixture
async def holding_proxy(redis_url: str) -> AsyncIterator[HoldingProxy]:
    """A HoldingProxy to the session's redis-server."""
    proxy = HoldingProxy(redis_url)
    await proxy.start()
    yield proxy
    await proxy.close()
